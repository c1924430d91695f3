"""Images as input (`engine_server.multimodal`): a tiny LLaVA checkpoint saved by transformers (a CLIP tower, its
projector, a random Llama text model; its tokenizer's `<image>` token, a parts-only chat template, CLIP's image
processor) served on the float path. The oracle is transformers itself: its `LlavaProcessor` lays out the same prompt
ids (each image's placeholder expanded to its patches' tokens), and `LlavaForConditionalGeneration` gives the same
greedy tokens, for one image, two, batched, prefilled in chunks that cut through an image's tokens, and served again
from the prefix cache; a prompt with other images behind the same placeholder ids never reads the first's cached
blocks. What the engine cannot read is refused by name."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.vl_checkpoints import QWEN_TEMPLATE, save_drawn, vision_tokenizer, wide_tower
from engine_server.cuda_graphs import EagerCapture
from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt
from engine_server.llm import LLM
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatAudio, ChatImage, ChatMessage
from tests.families import _SHAPE
from tests.unit.test_family_engines import engine
from tests.unit.test_frontend import PARTS_BY_LOOP

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

NEW_TOKENS = 12
IMAGE_SIZE = 56  # 4 x 4 patches of 14 pixels: 16 tokens an image (CLIP's class token dropped)
IMAGE_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
_CLIP = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": 14, "projection_dim": 32}  # fmt: skip


def png(seed: int, size: tuple[int, int] = (80, 64)) -> bytes:
    """A random RGB picture of `size` (width, height) as a PNG file."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def save_llava(folder: Path) -> Any:
    """A tiny LLaVA checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers import CLIPImageProcessor

    image_token = vision_tokenizer(folder, ["<image>"], PARTS_BY_LOOP).convert_tokens_to_ids("<image>")
    text = {**_SHAPE, "model_type": "llama", "vocab_size": image_token + 8}
    config = transformers.LlavaConfig(text_config=text, vision_config=_CLIP, image_token_id=image_token)
    model = save_drawn(folder, transformers.LlavaForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    size = {"shortest_edge": IMAGE_SIZE}
    CLIPImageProcessor(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return model


def wide_encoder(name: str) -> bool:
    """Whether a parameter is drawn wide: the tower's and the projector's, not the text model's (nor its head)."""
    return not any(part in name for part in ("language_model", "text_model", "lm_head"))


def save_vipllava(folder: Path) -> Any:
    """A tiny ViP-LLaVA checkpoint (LLaVA's CLIP tower, its features of three layers through ViP-LLaVA's projector:
    a LayerNorm, then two linears) saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers import CLIPImageProcessor

    image_token = vision_tokenizer(folder, ["<image>"], PARTS_BY_LOOP).convert_tokens_to_ids("<image>")
    text = {**_SHAPE, "model_type": "llama", "vocab_size": image_token + 8}
    config = transformers.VipLlavaConfig(text_config=text, vision_config=_CLIP, image_token_index=image_token,
                                         vision_feature_layer=[0, 1, -1])  # fmt: skip
    model = save_drawn(folder, transformers.VipLlavaForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    size = {"shortest_edge": IMAGE_SIZE}
    CLIPImageProcessor(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("llava-images")
    return folder, save_llava(folder)


@pytest.fixture(scope="module")
def served(llava: tuple[Path, Any]) -> Iterator[LLM]:
    with engine(llava[0]) as llm:
        yield llm


def user(*parts: str | bytes) -> ChatPrompt:
    """One user turn of text and images (a `bytes` part is an image file)."""
    content = tuple(ChatImage(part) if isinstance(part, bytes) else part for part in parts)
    return ChatPrompt([ChatMessage("user", content_parts=content)])


def processor_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `LlavaProcessor` inputs for `prompt`: its template's text and its images."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = [Image.open(io.BytesIO(part.data)).convert("RGB") for m in prompt.messages for _, part in m.images]
    processor = LlavaProcessor(
        AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer, patch_size=14,
        num_additional_image_tokens=1, vision_feature_select_strategy="default", chat_template=PARTS_BY_LOOP,
    )  # fmt: skip
    conversation = template_turns(prompt)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def template_turns(prompt: ChatPrompt) -> list[dict[str, Any]]:
    """`prompt`'s turns as transformers' processors take them: content as parts, an image `{"type": "image"}`, an audio
    clip `{"type": "audio"}`."""
    return [
        {"role": m.role, "content": [{"type": "text", "text": p} if isinstance(p, str)
                                     else {"type": "audio"} if isinstance(p, ChatAudio) else {"type": "image"}
                                     for p in m.content_parts or (m.content,)]}
        for m in prompt.messages
    ]  # fmt: skip


def assert_serves_like(
    folder: Path, model: Any, prompts: list[ChatPrompt], inputs: list[dict[str, torch.Tensor]], chunks: Sequence[int]
) -> None:
    """The engine on `folder`, prefilling at most each of `chunks` tokens a step, lays `prompts` out as `inputs` (the
    processor's) and answers them, batched, with `model`'s greedy tokens for each alone."""
    expected = [transformers_greedy(model, each) for each in inputs]
    for chunk in chunks:
        with engine(folder, chunk=chunk) as llm:
            results = llm.chat(prompts, GREEDY, use_tqdm=False)
        assert [result.prompt_token_ids for result in results] == [each["input_ids"][0].tolist() for each in inputs]
        assert [result.choices[0].token_ids for result in results] == expected


def transformers_greedy(model: Any, inputs: dict[str, torch.Tensor], new: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


PROMPTS = {
    "one image": lambda: user("What is in this picture?", png(1)),
    "image first": lambda: user(png(2), "Describe it."),
    "two images": lambda: user("Compare", png(3), "with", png(4, (40, 90)), "please."),
}


def image_prompts() -> list[ChatPrompt]:
    """Every case of `PROMPTS`, then a turn with no image."""
    return [*(PROMPTS[case]() for case in sorted(PROMPTS)), ChatPrompt([ChatMessage("user", "No picture here.")])]


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_an_image_prompt_is_laid_out_and_answered_as_transformers_does(
    case: str, llava: tuple[Path, Any], served: LLM
) -> None:
    folder, model = llava
    prompt = PROMPTS[case]()
    inputs = processor_inputs(folder, prompt)
    (result,) = served.chat([prompt], GREEDY, use_tqdm=False)
    assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert result.prompt_token_ids.count(model.config.image_token_id) == IMAGE_TOKENS * len(inputs["pixel_values"])
    assert result.choices[0].token_ids == transformers_greedy(model, inputs)


def test_a_vipllava_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """ViP-LLaVA (its tower's features of several layers, class token dropped, normed before LLaVA's projector): the
    prompt's ids are its processor's (LLaVA's); prompts with one image, two and none, batched, whole and in chunks of
    7, answer as transformers does."""
    model = save_vipllava(tmp_path)
    prompts = image_prompts()
    inputs = [processor_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 7))


@pytest.mark.parametrize("chunk", [7, 1])
def test_images_batched_and_prefilled_in_chunks_that_cut_through_them(chunk: int, llava: tuple[Path, Any]) -> None:
    """Three image prompts at once, 7 tokens a step (an image's 16 tokens span three chunks, one chunk two images),
    or one (every prompt token a step of one-token rows, as decodes are): each answer is transformers' for its prompt
    alone."""
    folder, model = llava
    prompts = [PROMPTS[case]() for case in sorted(PROMPTS)]
    expected = [transformers_greedy(model, processor_inputs(folder, prompt)) for prompt in prompts]
    with engine(folder, chunk=chunk) as llm:
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
    assert [result.choices[0].token_ids for result in results] == expected


def test_the_prefix_cache_keeps_apart_prompts_whose_images_differ(llava: tuple[Path, Any], served: LLM) -> None:
    """The same text with the same image is served again from the cache; with another image (the same placeholder ids)
    it reads none of the first's blocks, and answers as transformers does for that image."""
    folder, model = llava
    question = "Look closely at this picture and tell me everything you see in it, in order."
    first, again, other = user(question, png(11)), user(question, png(11)), user(question, png(12))
    results = [served.chat([prompt], GREEDY, use_tqdm=False)[0] for prompt in (first, again, other)]
    assert results[0].prompt_token_ids == results[2].prompt_token_ids  # placeholders alike, images not
    assert results[1].usage.cached_prompt_tokens >= 32
    assert results[1].choices[0].token_ids == results[0].choices[0].token_ids
    assert results[2].usage.cached_prompt_tokens == 0
    assert results[2].choices[0].token_ids == transformers_greedy(model, processor_inputs(folder, other))


def test_tokenize_counts_an_images_tokens(served: LLM) -> None:
    ids = served.inputs.tokenize(user("Hi", png(5)))
    assert len(ids) == len(served.inputs.tokenize(ChatPrompt([ChatMessage("user", "Hi")]))) + IMAGE_TOKENS


@pytest.mark.parametrize(
    ("messages", "match", "param"),
    [
        ([ChatMessage("user", content_parts=("Hi", ChatImage(b"not an image")))], "cannot be read",
         "messages[0].content[1]"),
        ([ChatMessage("user", "Hi"), ChatMessage("assistant", content_parts=(ChatImage(png(1)),))],
         "user turns only", "messages[1].content[0]"),
        ([ChatMessage("user", content_parts=("An <image> here:", ChatImage(png(1))))], "2 image placeholders for 1",
         "messages"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_read_is_refused_by_name(
    served: LLM, messages: list[ChatMessage], match: str, param: str
) -> None:
    with pytest.raises(ValidationError, match=match) as refused:
        served.chat([ChatPrompt(messages)], GREEDY, use_tqdm=False)
    assert refused.value.param == param


def test_an_image_too_large_is_refused_before_it_is_decoded(served: LLM) -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (8000, 6000)).save(out, format="PNG")  # 48 megapixels in a few kilobytes
    with pytest.raises(ValidationError, match="8000x6000 pixels") as refused:
        served.chat([user("Hi", out.getvalue())], GREEDY, use_tqdm=False)
    assert refused.value.param == "messages[0].content[1]"


def test_a_model_that_reads_no_images_refuses_one(tmp_path: Path) -> None:
    """A text model refuses an image turn by name; a Command A Vision checkpoint (its text model served) says its
    images are not yet."""
    from tests.families import save_family
    from tests.unit.test_multimodal_text_models import _multimodal, _saved

    text_model = save_family(tmp_path / "text", "llama")
    with engine(text_model) as llm, pytest.raises(ValidationError, match="reads no images") as refused:
        llm.chat([user("Hi", png(1))], GREEDY, use_tqdm=False)
    assert refused.value.param == "messages[0].content[1]"
    _saved(_multimodal("cohere2_vision"), tmp_path / "cohere2_vision")
    assert json.loads((tmp_path / "cohere2_vision" / "config.json").read_text())["model_type"] == "cohere2_vision"
    with engine(tmp_path / "cohere2_vision") as llm, pytest.raises(ValidationError, match="not served for cohere2"):
        llm.chat([user("Hi", png(1))], GREEDY, use_tqdm=False)


# The Qwen-VL kinds: a tiny tower of each (patches of 14 pixels, merged 2 x 2) beside a text model whose M-RoPE turns
# its 8 rotated pairs by time (2), height (3) and width (3).
QWEN_TOWERS = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                   "window_size": 56, "fullatt_block_indexes": [1]},
    "qwen3_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                 "patch_size": 14, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
}  # fmt: skip
QWEN_TOWERS["qwen3_vl_moe"] = QWEN_TOWERS["qwen3_vl"]
# The text model's keys beside the tests' shape: Qwen3-VL's rope interleaved, its MoE's experts.
_QWEN_TEXT = {
    "qwen3_vl": {"mrope_interleaved": True},
    "qwen3_vl_moe": {"mrope_interleaved": True, "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 24},
}  # fmt: skip
_QWEN_PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 12}  # 4 to 12 merged patches an image


def save_qwen_vl(folder: Path, kind: str) -> Any:
    """A tiny `kind` checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    from benchmarks.vl_checkpoints import save_qwen_vl as save

    extra = dict(_QWEN_TEXT.get(kind, {}))
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    if extra.pop("mrope_interleaved", False):
        rope["mrope_interleaved"] = True
    text = {**_SHAPE, "head_dim": 16, "rope_parameters": rope, **extra}
    return save(folder, kind, text, QWEN_TOWERS[kind], _QWEN_PIXELS)


@pytest.fixture(scope="module", params=sorted(QWEN_TOWERS))
def qwen_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_qwen_vl(folder, request.param)


def qwen_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' Qwen-VL processor's inputs for `prompt`."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    images = [Image.open(io.BytesIO(part.data)).convert("RGB") for m in prompt.messages for _, part in m.images]
    class ImagesOnly(Qwen2VLProcessor):  # type: ignore[misc]  # (its video processor would need torchvision)
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
            return type(argument)

    images_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # (the checkpoint's: Qwen's, GLM's)
    processor = ImagesOnly(images_processor, AutoTokenizer.from_pretrained(folder), video_processor=None,
                           chat_template=QWEN_TEMPLATE)  # fmt: skip
    conversation = template_turns(prompt)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_qwen_vl_prompt_takes_transformers_3d_positions(qwen_vl: tuple[Path, Any]) -> None:
    """The prompt's ids and M-RoPE positions (text, an image's grid of merged patches, text after it from the largest
    position on) and its delta are transformers' `get_rope_index`'s."""
    from engine_server.frontend import InputProcessor
    from engine_server.hf_config import model_config_from_hf
    from engine_server.multimodal.processing import served_images
    from engine_server.tokenizer.loading import load_tokenizer

    folder, model = qwen_vl
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    images, _ = served_images(config.multimodal, folder)
    inputs = InputProcessor(load_tokenizer(folder), config.vocab_size, 4096, (), images=images)
    prompt = user("Compare", png(3), "with", png(4, (40, 90)), "please.")
    prepared = inputs.prepare(prompt, GREEDY)
    theirs = qwen_inputs(folder, prompt)
    assert prepared.token_ids == theirs["input_ids"][0].tolist()
    positions, delta = model.model.get_rope_index(theirs["input_ids"], theirs["mm_token_type_ids"],
                                                  image_grid_thw=theirs["image_grid_thw"])  # fmt: skip
    assert prepared.multimodal is not None and prepared.multimodal.positions is not None
    assert torch.equal(prepared.multimodal.positions, positions[:, 0])
    assert prepared.multimodal.position_delta == int(delta) < 0


@pytest.mark.parametrize(("chunk", "graphs"), [(2048, False), (7, False), (1, False), (2048, True)])
def test_a_qwen_vl_checkpoint_answers_image_prompts_as_transformers_does(
    chunk: int, graphs: bool, qwen_vl: tuple[Path, Any]
) -> None:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (interleaved M-RoPE, DeepStack features added after the first
    layers): prompts with one image, two and none, batched, prefilled whole, in chunks of 7 and of 1 token, and decoded
    through the decode graphs' path: each answer (decoded at the positions after the images) is transformers' for its
    prompt alone."""
    folder, model = qwen_vl
    prompts = image_prompts()
    expected = [transformers_greedy(model, qwen_inputs(folder, prompt)) for prompt in prompts]
    with engine(folder, chunk=chunk) as llm:
        if graphs:  # the decode graphs' padded static buffers (CUDA's path), their rows' positions shifted
            llm.core.runner.capture_decode_graphs(EagerCapture())
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
        replays = llm.core.runner.decode_graphs.replays if graphs else {}
    assert [result.choices[0].token_ids for result in results] == expected
    assert not graphs or sum(replays.values()) >= NEW_TOKENS - 1


def test_an_image_is_encoded_once_for_the_requests_that_share_it_and_forgotten_after(
    served: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two choices (`n=2`) and a second request with the same image, in flight together: the encoder runs once; once
    they finish no image's features are kept."""
    features = served.core.runner.image_features
    assert features is not None
    encode = features.encoder.encode
    calls: list[int] = []

    def counted(pixel_values: torch.Tensor, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        calls.append(1)
        return encode(pixel_values, grid)

    monkeypatch.setattr(features.encoder, "encode", counted)
    twice = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)
    results = served.chat([user("What is this?", png(21)), user("And this?", png(21))], twice, use_tqdm=False)
    assert [len(result.choices) for result in results] == [2, 2]
    assert len(calls) == 1
    assert features.num_images == 0


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "gemma3"])
def test_the_quantized_default_reads_images_batch_invariantly(kind: str, tmp_path: Path) -> None:
    """On the CPU's default path (int8 text model, the decode stack; the tower in float) image prompts run, and each
    prompt's tokens alone equal its tokens batched with the others."""
    savers = {"llava": save_llava, "qwen2_5_vl": lambda folder: save_qwen_vl(folder, "qwen2_5_vl"),
              "gemma3": save_gemma3}  # fmt: skip
    savers[kind](tmp_path)
    prompts = image_prompts()
    with engine(tmp_path, quantization="int8") as llm:
        assert llm.core.runner.quantization == "int8" and llm.core.runner.image_features is not None
        batched = [result.choices[0].token_ids for result in llm.chat(prompts, GREEDY, use_tqdm=False)]
        alone = [llm.chat([prompt], GREEDY, use_tqdm=False)[0].choices[0].token_ids for prompt in prompts]
    assert batched == alone
    assert all(len(tokens) == NEW_TOKENS for tokens in batched)


def test_images_over_a_decoder_that_lays_no_image_rows_are_refused_at_load(
    llava: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose images would be served over a text model with a decoder of its own (one that does not lay
    the image rows over its embeddings) does not start, rather than answer without its images."""
    from engine_server.layers import decoder

    class OwnForward(decoder.DecoderModel):
        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return super().forward(*args, **kwargs)

    from engine_server.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "decoder_class", OwnForward)
    with pytest.raises(ValueError, match="not over OwnForward"):
        engine(llava[0])


def test_where_images_are_not_served_the_refusal_says_why(llava: tuple[Path, Any], tmp_path: Path) -> None:
    """Without the checkpoint's image processor a LLaVA checkpoint serves its text model and refuses images, saying
    why; no vision encoder is loaded for it."""
    import shutil

    from engine_server.hf_config import model_config_from_hf
    from engine_server.multimodal.processing import images_refusal, served_images

    folder = llava[0]
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    assert served_images(config.multimodal, folder)[0] is not None
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "preprocessor_config.json").unlink()
    assert "no image processor" in images_refusal(config.multimodal, bare)
    assert served_images(config.multimodal, bare) == (None, images_refusal(config.multimodal, bare))
    with engine(bare) as llm:
        assert llm.core.runner.image_features is None
        with pytest.raises(ValidationError, match="no image processor"):
            llm.chat([user("Hi", png(1))], GREEDY, use_tqdm=False)


def test_image_prompts_preempted_and_recomputed_answer_as_transformers_does(qwen_vl: tuple[Path, Any]) -> None:
    """Eight image prompts, 48 new tokens each, in a KV pool of 17 blocks (one 256-token sequence), 16 tokens a step:
    requests are preempted and recomputed (their images' rows read again, their positions laid out again), and each
    answer is still transformers'."""
    folder, model = qwen_vl
    prompts = [user("Picture", png(30 + i), f"number {i}: what is in it?") for i in range(8)]
    expected = [transformers_greedy(model, qwen_inputs(folder, prompt), 48) for prompt in prompts]
    with engine(folder, chunk=16, kv_blocks=17) as llm:
        results = llm.chat(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
        assert llm.core.scheduler.total_preemptions > 0
        assert llm.core.runner.image_features is not None and llm.core.runner.image_features.num_images == 0
    assert [result.choices[0].token_ids for result in results] == expected


# Mistral 3 over a tiny Pixtral tower: images up to 112 pixels a side, in merged patches of 28 (a row of them, then a
# row break; the last row an image end).
MISTRAL_TEMPLATE = (
    "{% for m in messages %}[INST]{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}[IMG]{% endif %}{% endfor %}[/INST]{% endfor %}"
)
_PIXTRAL = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 16, "image_size": 112, "patch_size": 14}  # fmt: skip
_MARKS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def save_mistral3(folder: Path) -> Any:
    """A tiny Mistral 3 checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    image, _, end = vision_tokenizer(folder, _MARKS, MISTRAL_TEMPLATE).convert_tokens_to_ids(_MARKS)
    text = {**_SHAPE, "model_type": "mistral", "head_dim": 16, "vocab_size": end + 8}
    config = transformers.Mistral3Config(text_config=text, vision_config=_PIXTRAL, image_token_id=image,
                                         spatial_merge_size=2)  # fmt: skip
    model = save_drawn(folder, transformers.Mistral3ForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("mistral3")
    return folder, save_mistral3(folder)


def rendered(folder: Path, prompt: ChatPrompt, template: str) -> tuple[Any, str, list[Any]]:
    """The checkpoint's tokenizer, `prompt` rendered by `template` (its content as parts) and its images, decoded."""
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(template_turns(prompt), chat_template=template, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    images = [Image.open(io.BytesIO(part.data)).convert("RGB") for m in prompt.messages for _, part in m.images]
    return tokenizer, text, images


def expanded_ids(tokenizer: Any, text: str, placeholder: str, layouts: list[str]) -> torch.Tensor:
    """The ids `[1, T]` of `text` with its i-th `placeholder` replaced by `layouts[i]` (the processors' text)."""
    pieces = text.split(placeholder)
    joined = pieces[0] + "".join(layout + piece for layout, piece in zip(layouts, pieces[1:], strict=True))
    ids: torch.Tensor = tokenizer(joined, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids


def pixtral_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs for `prompt` as its `PixtralProcessor` lays them out for Mistral 3 (merged patches of 2 x 2:
    each row's `[IMG]` tokens then `[IMG_BREAK]`, the last row's break an `[IMG_END]`, by the image's processed size;
    the processor's module itself needs torchvision to import, so its layout is written out here)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer, text, images = rendered(folder, prompt, MISTRAL_TEMPLATE)
    if not images:
        return {"input_ids": expanded_ids(tokenizer, text, "[IMG]", [])}
    processed = PixtralImageProcessorPil(size={"longest_edge": 112})(images=images, patch_size=28, return_tensors="pt")
    layouts = [("[IMG]" * (width // 28) + "[IMG_BREAK]") * (height // 28) for height, width in
               processed["image_sizes"].tolist()]  # fmt: skip
    ids = expanded_ids(tokenizer, text, "[IMG]", [layout.removesuffix("[IMG_BREAK]") + "[IMG_END]"
                                                  for layout in layouts])  # fmt: skip
    return {"input_ids": ids, "pixel_values": processed["pixel_values"], "image_sizes": processed["image_sizes"]}


@pytest.mark.parametrize("chunk", [2048, 5])
def test_a_mistral3_checkpoint_answers_image_prompts_as_transformers_does(
    chunk: int, mistral3: tuple[Path, Any]
) -> None:
    """Mistral 3 (Pixtral's rows of merged patches, each row's tokens then a break, the last an image end): the prompt's
    ids are transformers' processor's; prompts with one image, two and none, batched, whole and in chunks of 5 (that
    cut rows and breaks), answer as transformers does."""
    folder, model = mistral3
    prompts = image_prompts()
    inputs = [pixtral_inputs(folder, prompt) for prompt in prompts]
    expected = [transformers_greedy(model, each) for each in inputs]
    with engine(folder, chunk=chunk) as llm:
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
    assert [result.prompt_token_ids for result in results] == [each["input_ids"][0].tolist() for each in inputs]
    assert [result.choices[0].token_ids for result in results] == expected


# InternVL over a tiny InternViT: tiles of 56 pixels (4 x 4 patches of 14, pixel-shuffled into 2 x 2: 4 tokens a
# tile), up to 4 tiles and a thumbnail an image.
INTERNVL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<IMG_CONTEXT>\n{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_INTERNVIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": [56, 56], "patch_size": [14, 14]}  # fmt: skip
_INTERNVL_TILES = {"size": {"height": 56, "width": 56}, "max_patches": 4}


def save_internvl(folder: Path) -> Any:
    """A tiny InternVL checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer = vision_tokenizer(folder, ["<img>", "</img>", "<IMG_CONTEXT>"], INTERNVL_TEMPLATE)
    context = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    text = {**_SHAPE, "model_type": "qwen2", "head_dim": 16, "vocab_size": context + 8}
    config = transformers.InternVLConfig(text_config=text, vision_config=_INTERNVIT, image_token_id=context,
                                         image_seq_length=4)  # fmt: skip
    model = save_drawn(folder, transformers.InternVLForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    GotOcr2ImageProcessorPil(**_INTERNVL_TILES).save_pretrained(folder)
    return model


def internvl_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs for `prompt` as its `InternVLProcessor` lays them out (each `<IMG_CONTEXT>` the template
    writes becomes `<img>`, 4 tokens a tile, `</img>`, its tiles cropped as the processor asks; the processor itself
    needs torchvision for its video processor, so its layout is written out here)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer, text, images = rendered(folder, prompt, INTERNVL_TEMPLATE)
    if not images:
        return {"input_ids": expanded_ids(tokenizer, text, "<IMG_CONTEXT>", [])}
    processed = GotOcr2ImageProcessorPil(**_INTERNVL_TILES)(images=images, crop_to_patches=True, return_tensors="pt")
    layouts = ["<img>" + "<IMG_CONTEXT>" * (4 * tiles) + "</img>" for tiles in processed["num_patches"].tolist()]
    ids = expanded_ids(tokenizer, text, "<IMG_CONTEXT>", layouts)
    return {"input_ids": ids, "pixel_values": processed["pixel_values"]}


def test_an_internvl_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """InternVL (an image in tiles and a thumbnail, their tokens between `<img>` and `</img>`): the prompt's ids are
    its processor's layout; prompts with one image, two and none, batched, whole and in chunks of 5, answer as
    transformers does."""
    model = save_internvl(tmp_path)
    prompts = image_prompts()
    inputs = [internvl_inputs(tmp_path, prompt) for prompt in prompts]
    assert any(each.get("pixel_values", torch.zeros(1)).shape[0] > 2 for each in inputs)  # (images of several tiles)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# Idefics 3 and SmolVLM over a tiny SigLIP: an image up to 112 pixels a side split into tiles of 56 (4 x 4 patches of
# 14, pixel-shuffled by 2 into 4 tokens a tile) and a global view.
_SPLIT_MARKS = ["<fake_token_around_image>", "<image>", "<global-img>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))]  # fmt: skip
_TILED_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "image_size": 56, "patch_size": 14}  # fmt: skip
_SPLITTING = {"size": {"longest_edge": 112}, "max_image_size": {"longest_edge": 56}, "do_image_splitting": True}
_SPLIT_STEMS = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}


def save_split_images_model(folder: Path, kind: str) -> Any:
    """A tiny Idefics 3 or SmolVLM checkpoint that reads images, saved in `folder` as transformers saves it."""
    import importlib

    import transformers

    tokenizer = vision_tokenizer(folder, _SPLIT_MARKS, PARTS_BY_LOOP)
    image = tokenizer.convert_tokens_to_ids("<image>")
    text = {**_SHAPE, "model_type": "llama", "vocab_size": len(tokenizer) + 8}
    stem = _SPLIT_STEMS[kind]
    config = getattr(transformers, f"{stem}Config")(text_config=text, vision_config=_TILED_SIGLIP, scale_factor=2,
                                                     image_token_id=image)  # fmt: skip
    model = save_drawn(folder, getattr(transformers, f"{stem}ForConditionalGeneration"), config, wide_encoder,
                       (0.08, 0.3))  # fmt: skip
    pil = importlib.import_module(f"transformers.models.{kind}.image_processing_pil_{kind}")
    getattr(pil, f"{stem}ImageProcessorPil")(**_SPLITTING).save_pretrained(folder)
    return model


def split_images_inputs(folder: Path, kind: str, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs for `prompt` as its processor lays them out (each `<image>` the template writes becomes
    transformers' `get_image_prompt_string` of the image's rows and columns of tiles; the processor itself needs
    torchvision for SmolVLM's video processor, so it is called here piece by piece)."""
    import importlib

    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    if not images:
        return {"input_ids": expanded_ids(tokenizer, text, "<image>", [])}
    pil = importlib.import_module(f"transformers.models.{kind}.image_processing_pil_{kind}")
    processor = getattr(pil, f"{_SPLIT_STEMS[kind]}ImageProcessorPil")(**_SPLITTING)
    processed = processor(images=[images], return_tensors="pt", return_row_col_info=True)
    layouts = [get_image_prompt_string(rows, cols, 4, "<fake_token_around_image>", "<image>", "<global-img>")
               for rows, cols in zip(processed["rows"][0], processed["cols"][0], strict=True)]  # fmt: skip
    ids = expanded_ids(tokenizer, text, "<image>", layouts)
    return {"input_ids": ids, "pixel_values": processed["pixel_values"],
            "pixel_attention_mask": processed["pixel_attention_mask"]}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_SPLIT_STEMS))
def test_idefics3_and_smolvlm_answer_image_prompts_as_transformers_does(kind: str, tmp_path: Path) -> None:
    """Idefics 3 and SmolVLM (an image split into rows x columns of tiles and a global view, each tile's tokens after
    its row and column token): the prompt's ids are its processor's layout; prompts with one image, two and none,
    batched, whole and in chunks of 5, answer as transformers does."""
    model = save_split_images_model(tmp_path, kind)
    prompts = image_prompts()
    inputs = [split_images_inputs(tmp_path, kind, prompt) for prompt in prompts]
    assert inputs[0]["pixel_values"].shape[1] > 2  # (an image of several tiles beside its global view)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# Idefics 2 over a tiny SigLIP-like tower (patches of 14) and a perceiver of 4 latents beside a Mistral text model:
# images resized to 28 to 56 pixels a side (not whole patches: each tile's pixel mask covers its whole patches), split
# or not into their four quarters and themselves.
_IDEFICS2_MARKS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
_IDEFICS2_PERCEIVER = {"hidden_size": _SHAPE["hidden_size"], "rms_norm_eps": 1e-6, "resampler_n_latents": 4,
                       "resampler_depth": 2, "resampler_n_heads": 2, "resampler_head_dim": 16, "num_key_value_heads": 1}


def save_idefics2(folder: Path, splitting: bool) -> Any:
    """A tiny Idefics 2 checkpoint that reads images (split into tiles or not), saved in `folder` as transformers saves
    it; returns the model."""
    import transformers
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    image = vision_tokenizer(folder, _IDEFICS2_MARKS, PARTS_BY_LOOP).convert_tokens_to_ids("<image>")
    text = {**_SHAPE, "model_type": "mistral", "head_dim": 16, "vocab_size": image + 8}
    config = transformers.Idefics2Config(text_config=text, vision_config=_TILED_SIGLIP,
                                         perceiver_config=_IDEFICS2_PERCEIVER, image_token_id=image)  # fmt: skip
    model = save_drawn(folder, transformers.Idefics2ForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    Idefics2ImageProcessorPil(size={"shortest_edge": 28, "longest_edge": 56},
                              do_image_splitting=splitting).save_pretrained(folder)  # fmt: skip
    return model


def idefics2_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `Idefics2Processor` inputs for `prompt` (its images' tiles padded to the largest of the prompt's,
    their pixel masks)."""
    from transformers import AutoImageProcessor, Idefics2Processor

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    processor = Idefics2Processor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                  image_seq_len=4)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=[images] if images else None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


@pytest.mark.parametrize("splitting", [False, True])
def test_an_idefics2_checkpoint_answers_image_prompts_as_transformers_does(splitting: bool, tmp_path: Path) -> None:
    """Idefics 2 (an image's 4 latents' tokens between `<fake_token_around_image>` marks; split, its four quarters'
    then its own, one mark apart; adjacent images share the mark between them, text right after one starts with a
    space): the prompt's ids are its processor's; prompts with one image, two apart, two adjacent and none, batched,
    whole and in chunks of 5 (that cut through tiles), answer as transformers does for each prompt alone (its images'
    tiles padded to the largest of the prompt's; the engine's to the largest of the image's). A text that spells the
    placeholder is refused."""
    model = save_idefics2(tmp_path, splitting)
    prompts = [*(PROMPTS[case]() for case in sorted(PROMPTS)), ChatPrompt([ChatMessage("user", "No picture here.")]),
               user("Which is brighter:", png(5), png(6, (50, 30)), "or?")]  # fmt: skip
    inputs = [idefics2_inputs(tmp_path, prompt) for prompt in prompts]
    tiles = 5 if splitting else 1
    assert inputs[0]["pixel_values"].shape[1] == tiles
    assert not inputs[2]["pixel_attention_mask"].all()  # (tiles, or the prompt's two images, padded)
    fake = model.config.image_token_id - 1  # (`<fake_token_around_image>`, added just before `<image>`)
    assert inputs[-1]["input_ids"][0].tolist().count(fake) == 2 * (tiles + 1) - 1  # (one shared by the two)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))
    with engine(tmp_path) as llm, pytest.raises(ValidationError, match="do not lay out 1 images"):
        llm.chat([user("An <image> here:", png(1))], GREEDY, use_tqdm=False)  # (the text spells the placeholder)


# GLM-4.1V, GLM-4.5V and GLM-4.6V: Qwen2-VL's layout (patches of 14 merged 2 x 2, M-RoPE) over GLM's tower and text
# model (rope over half of each 16-wide head: 4 rotated pairs, turned by time (1), height (1) and width (2)).
_GLM_TOWER = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "image_size": 56, "patch_size": 14}  # fmt: skip
_GLM_TEXT = {"glm4v": {}, "glm46v": {},
             "glm4v_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                           "first_k_dense_replace": 1, "n_shared_experts": 1, "use_qk_norm": False}}  # fmt: skip
_GLM_STEMS = {"glm4v": "Glm4v", "glm4v_moe": "Glm4vMoe", "glm46v": "Glm46V"}


def save_glm4v(folder: Path, kind: str) -> Any:
    """A tiny GLM-4.1V (`glm4v`), GLM-4.5V (`glm4v_moe`) or GLM-4.6V (`glm46v`) checkpoint that reads images, saved
    in `folder` as transformers saves it, with Qwen-VL's vision tokens and template (the tokens' names are the
    tokenizer's); returns the model."""
    import transformers
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    marks = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    ids: Any = vision_tokenizer(folder, marks, QWEN_TEMPLATE).convert_tokens_to_ids(marks)
    start, image, end, video = (int(i) for i in ids)
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
    text = {**_SHAPE, "head_dim": 16, "vocab_size": video + 8, "rope_parameters": rope, **_GLM_TEXT[kind]}
    stem = _GLM_STEMS[kind]
    config = getattr(transformers, f"{stem}Config")(
        text_config=text, vision_config=_GLM_TOWER, image_token_id=image, video_token_id=video,
        image_start_token_id=start, image_end_token_id=end,
    )  # fmt: skip
    model = save_drawn(folder, getattr(transformers, f"{stem}ForConditionalGeneration"), config, wide_tower,
                       (0.08, 0.3))  # fmt: skip
    Glm4vImageProcessorPil(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 12}).save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", sorted(_GLM_STEMS))
def test_glm4v_checkpoints_answer_image_prompts_as_transformers_does(kind: str, tmp_path: Path) -> None:
    """GLM-4.1V, GLM-4.5V and GLM-4.6V (M-RoPE over half of each head): prompts with one image, two and none,
    batched, whole and in chunks of 7, answer as transformers does (prompt ids as its processor lays them out)."""
    model = save_glm4v(tmp_path, kind)
    prompts = image_prompts()
    inputs = [qwen_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 7))


# LLaVA-NeXT over a tiny CLIP tower of 28 pixels (2 x 2 patches): an image's tiles on the best grid of 28-pixel tiles
# up to 56 x 56, and its base view.
_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def save_llava_next(folder: Path, stem: str = "LlavaNext") -> Any:
    """A tiny LLaVA-NeXT checkpoint (`stem` "LlavaNextVideo": LLaVA-NeXT-Video's) that reads images, saved in `folder`
    as transformers saves it; returns the model."""
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = vision_tokenizer(folder, ["<image>", "<video>"], PARTS_BY_LOOP)
    image_token, video_token = (int(i) for i in tokenizer.convert_tokens_to_ids(["<image>", "<video>"]))
    text = {**_SHAPE, "model_type": "mistral", "head_dim": 16, "vocab_size": video_token + 8}
    tokens = {"image_token_id": image_token} | ({"video_token_id": video_token} if "Video" in stem else {})
    config = getattr(transformers, f"{stem}Config")(text_config=text, vision_config={**_CLIP, "image_size": 28},
                                                    image_grid_pinpoints=_PINPOINTS, **tokens)  # fmt: skip
    model_class = getattr(transformers, f"{stem}ForConditionalGeneration")
    model = save_drawn(folder, model_class, config, wide_encoder, (0.08, 0.3))
    LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                               image_grid_pinpoints=_PINPOINTS).save_pretrained(folder)  # fmt: skip
    return model


def llava_next_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `LlavaNextProcessor` inputs for `prompt`."""
    from transformers import AutoImageProcessor, LlavaNextProcessor

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    processor = LlavaNextProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                   patch_size=14, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def llava_next_video_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `LlavaNextVideoProcessor` inputs for `prompt` (its images alone: no video processor)."""
    from transformers import AutoImageProcessor, LlavaNextVideoProcessor

    class ImagesOnly(LlavaNextVideoProcessor):  # type: ignore[misc]  # (its video processor would need torchvision)
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
            return type(argument)

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    processor = ImagesOnly(video_processor=None, image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                           vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_llava_next_video_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """LLaVA-NeXT-Video's images (LLaVA-NeXT's: tiles on the best grid, unpadded, newlines): the prompt's ids are its
    own processor's; prompts with one image, two and none, batched, whole and in chunks of 5, answer as transformers
    does (its videos are not read)."""
    model = save_llava_next(tmp_path, "LlavaNextVideo")
    prompts = image_prompts()
    inputs = [llava_next_video_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


def test_a_llava_next_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """LLaVA-NeXT (any resolution: an image's tiles on its best grid beside its base view, unpadded, a newline
    embedding after each row): the prompt's ids are its processor's; prompts with one image, two (of other aspects)
    and none, batched, whole and in chunks of 5, answer as transformers does."""
    model = save_llava_next(tmp_path)
    prompts = image_prompts()
    inputs = [llava_next_inputs(tmp_path, prompt) for prompt in prompts]
    assert inputs[0]["pixel_values"].shape[1] > 2  # (an image of several tiles beside its base view)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# Gemma 3 over a tiny SigLIP (56 pixels, 4 x 4 patches of 14: 16 tokens an image) beside the family tests' Gemma 3
# text model, its windows narrowed to 8 tokens: an image's tokens attend to each other both ways, within the window on
# the windowed layers.
GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<start_of_image>{% endif %}"
    "{% endfor %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_GEMMA3_MARKS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>"]
_GEMMA3_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "patch_size": 14, "image_size": 56}  # fmt: skip


def save_gemma3(folder: Path) -> Any:
    """A tiny Gemma 3 checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.families import FAMILIES

    boi, soft, eoi = vision_tokenizer(folder, _GEMMA3_MARKS, GEMMA3_TEMPLATE).convert_tokens_to_ids(_GEMMA3_MARKS[:3])
    text = {**_SHAPE, "model_type": "gemma3_text", **FAMILIES["gemma3"][1], "sliding_window": 8, "vocab_size": eoi + 8}
    config = transformers.Gemma3Config(text_config=text, vision_config=_GEMMA3_SIGLIP, mm_tokens_per_image=16,
                                       image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi)  # fmt: skip
    model = save_drawn(folder, transformers.Gemma3ForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    return model


def gemma3_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `Gemma3Processor` inputs for `prompt` (with its image token type ids, which give the model its
    images' two-way mask)."""
    from transformers import AutoImageProcessor, Gemma3Processor

    tokenizer, text, images = rendered(folder, prompt, GEMMA3_TEMPLATE)
    for name, mark in zip(("boi_token", "image_token", "eoi_token"), _GEMMA3_MARKS, strict=False):
        setattr(tokenizer, name, mark)  # (a Gemma 3 tokenizer's own names for its image marks)
        setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(mark))
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                image_seq_length=16)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_gemma3_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """Gemma 3 (an image's tokens attend to each other both ways; on the windowed layers within the window): the
    prompt's ids are its processor's; prompts with one image, two and none, batched, whole and in chunks of 20 (a
    chunk ends before an image or after it, never inside), answer as transformers does. An engine whose steps take
    fewer tokens than an image refuses images, saying so."""
    model = save_gemma3(tmp_path)
    prompts = image_prompts()
    inputs = [gemma3_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 20))
    with engine(tmp_path, chunk=8) as llm, pytest.raises(ValidationError, match="16 tokens run in one step"):
        llm.chat(prompts[:1], GREEDY, use_tqdm=False)


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways() -> None:
    """The scheduler's chunk of a prompt whose images attend both ways (Gemma 3's): cut before an image; from an image's
    start (or inside it, after a prefix-cache hit) stretched to its end past a smaller prefill allowance where the
    step's budget holds it, else none; an image that attends causally is cut anywhere."""
    from engine_server.core.request import Request
    from engine_server.core.scheduler import whole_images
    from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs

    span = ImageSpan(10, 16, torch.zeros(3, 2, 2), b"digest")
    request = Request("r", list(range(40)), GREEDY, max_model_len=256,
                      multimodal=MultimodalInputs((span,), bidirectional=True))  # fmt: skip
    assert whole_images(request, 0, 8, 40) == 8  # (ends before the image)
    assert whole_images(request, 0, 12, 40) == 10  # (would end inside it: cut before it)
    assert whole_images(request, 10, 8, 40) == 16  # (from its start: the whole image, past the allowance of 8)
    assert whole_images(request, 16, 4, 40) == 10  # (from inside it: its rest)
    assert whole_images(request, 10, 8, 12) == 0  # (the budget does not hold it: the request waits)
    assert whole_images(request, 10, 30, 40) == 30  # (the image and more)
    causal = Request("c", list(range(40)), GREEDY, max_model_len=256, multimodal=MultimodalInputs((span,)))
    assert whole_images(causal, 0, 12, 40) == 12


# Aya Vision over a tiny SigLIP (tiles of 56 pixels: 4 x 4 patches of 14, pixel-shuffled by 2 into 4 tokens a tile)
# beside Command R7B's text model (the family tests' Cohere 2).
_AYA_MARKS = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_LINE_BREAK|>", "<image>", "<|IMG_PATCH|>"]
_AYA_TILES = {"size": {"height": 56, "width": 56}, "max_patches": 4}


def save_aya_vision(folder: Path) -> Any:
    """A tiny Aya Vision checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from tests.families import FAMILIES

    patch = vision_tokenizer(folder, _AYA_MARKS, PARTS_BY_LOOP).convert_tokens_to_ids("<|IMG_PATCH|>")
    text = {**_SHAPE, "model_type": "cohere2", **FAMILIES["cohere2"][1], "vocab_size": patch + 8}
    vision = {**_GEMMA3_SIGLIP, "model_type": "siglip_vision_model"}
    config = transformers.AyaVisionConfig(text_config=text, vision_config=vision, downsample_factor=2,
                                          image_token_index=patch)  # fmt: skip
    model = save_drawn(folder, transformers.AyaVisionForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    GotOcr2ImageProcessorPil(**_AYA_TILES).save_pretrained(folder)
    return model


def aya_vision_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `AyaVisionProcessor` inputs for `prompt`."""
    from transformers import AutoImageProcessor, AyaVisionProcessor

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    processor = AyaVisionProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer, img_size=56,
                                   patch_size=28)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_an_aya_vision_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """Aya Vision (an image in tiles, each tile's patch tokens after its tile tokens, then the global view's, between
    its start and end tokens): the prompt's ids are its processor's; prompts with one image, two and none, batched,
    whole and in chunks of 5, answer as transformers does."""
    model = save_aya_vision(tmp_path)
    prompts = image_prompts()
    inputs = [aya_vision_inputs(tmp_path, prompt) for prompt in prompts]
    assert any(len(each.get("pixel_values", ())) > 2 for each in inputs)  # (several tiles beside a global view)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# DeepSeek-VL over a tiny SigLIP (56 pixels, 4 x 4 patches of 14: 16 tokens an image) beside a random Llama; the
# tokenizer names its image token (`image_token`), as the converted checkpoints' do, for the processor.
DEEPSEEK_TEMPLATE = PARTS_BY_LOOP.replace("<image>", "<image_placeholder>")


def named_tokenizer(folder: Path, names: dict[str, str], template: str) -> Any:
    """`vision_tokenizer` with `names`' tokens added and named (`tokenizer.image_token`, ... as the processors read
    them), saved in `folder`; returns it."""
    from transformers import AutoTokenizer

    vision_tokenizer(folder, list(names.values()), template)
    tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=names)
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_deepseek_vl(folder: Path) -> Any:
    """A tiny DeepSeek-VL checkpoint that reads images, saved in `folder` as transformers saves it; returns the
    model."""
    import transformers
    from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import DeepseekVLImageProcessorPil

    tokenizer = named_tokenizer(folder, {"image_token": "<image_placeholder>"}, DEEPSEEK_TEMPLATE)
    image = tokenizer.convert_tokens_to_ids("<image_placeholder>")
    text = {**_SHAPE, "model_type": "llama", "vocab_size": image + 8}
    vision = {**_GEMMA3_SIGLIP, "model_type": "siglip_vision_model"}
    config = transformers.DeepseekVLConfig(text_config=text, vision_config=vision, image_token_id=image)
    model = save_drawn(folder, transformers.DeepseekVLForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    DeepseekVLImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    return model


def deepseek_vl_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `DeepseekVLProcessor` inputs for `prompt` (16 image tokens an image)."""
    from transformers import AutoImageProcessor, DeepseekVLProcessor

    tokenizer, text, images = rendered(folder, prompt, DEEPSEEK_TEMPLATE)
    processor = DeepseekVLProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                    num_image_tokens=16)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_deepseek_vl_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """DeepSeek-VL (an image padded to a square, its SigLIP tower's patches through the aligner, `num_image_tokens`
    tokens an image): the prompt's ids are its processor's; prompts with one image, two (of other aspects) and none,
    batched, whole and in chunks of 5, answer as transformers does."""
    model = save_deepseek_vl(tmp_path)
    prompts = image_prompts()
    inputs = [deepseek_vl_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# Janus over its tiny vision model (56 pixels, 4 x 4 patches of 14: `num_image_tokens` 16) and a tiny VQ model (its
# image generation's, not read), beside a random Llama; its tokenizer names its image, begin and end tokens.
_JANUS_TOKENS = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}
_JANUS_VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_ratio": 2,
                 "image_size": 56, "patch_size": 14, "num_image_tokens": 16, "projection_dim": 64}  # fmt: skip
_JANUS_VQ = {"embed_dim": 8, "num_embeddings": 32, "latent_channels": 32, "base_channels": 32,
             "channel_multiplier": [1, 1], "num_res_blocks": 1, "projection_dim": 64, "image_token_embed_dim": 32}


def save_janus(folder: Path) -> Any:
    """A tiny Janus checkpoint that reads images, saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    tokenizer = named_tokenizer(folder, _JANUS_TOKENS, DEEPSEEK_TEMPLATE)
    image, end = tokenizer.convert_tokens_to_ids(["<image_placeholder>", "<end_of_image>"])
    text = {**_SHAPE, "model_type": "llama", "vocab_size": end + 8}
    config = transformers.JanusConfig(text_config=text, vision_config=_JANUS_VISION, vq_config=_JANUS_VQ,
                                      image_token_id=image)  # fmt: skip
    model = save_drawn(folder, transformers.JanusForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    JanusImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    return model


def janus_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `JanusProcessor` inputs for `prompt` (16 image tokens an image between its begin and end
    tokens)."""
    from transformers import AutoImageProcessor, JanusProcessor

    tokenizer, text, images = rendered(folder, prompt, DEEPSEEK_TEMPLATE)
    processor = JanusProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                               num_image_tokens=16)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_janus_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """Janus's understanding path (an image padded to a square, its vision model's patches through the aligner,
    `num_image_tokens` tokens between `<begin_of_image>` and `<end_of_image>`): the prompt's ids are its processor's;
    prompts with one image, two and none, batched, whole and in chunks of 5, answer as transformers does."""
    model = save_janus(tmp_path)
    prompts = image_prompts()
    inputs = [janus_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


# DeepSeek-VL hybrid: DeepSeek-VL's tiny SigLIP beside a tiny SAM (64 pixels, 4 x 4 patches of 16, its second layer
# global), its global branch's weight drawn (transformers starts it at zero).
_SAM = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_dim": 64,
        "image_size": 64, "patch_size": 16, "global_attn_indexes": [1], "window_size": 2}  # fmt: skip


def save_deepseek_vl_hybrid(folder: Path) -> Any:
    """A tiny DeepSeek-VL hybrid checkpoint that reads images, saved in `folder` as transformers saves it; returns the
    model."""
    import transformers
    from transformers.models.deepseek_vl_hybrid.image_processing_pil_deepseek_vl_hybrid import (
        DeepseekVLHybridImageProcessorPil,
    )

    tokenizer = named_tokenizer(folder, {"image_token": "<image_placeholder>"}, DEEPSEEK_TEMPLATE)
    image = tokenizer.convert_tokens_to_ids("<image_placeholder>")
    text = {**_SHAPE, "model_type": "llama", "vocab_size": image + 8}
    vision = {**_GEMMA3_SIGLIP, "model_type": "siglip_vision_model"}
    config = transformers.DeepseekVLHybridConfig(text_config=text, vision_config=vision, high_res_vision_config=_SAM,
                                                 image_token_id=image)  # fmt: skip
    model = save_drawn(folder, transformers.DeepseekVLHybridForConditionalGeneration, config, wide_encoder,
                       (0.08, 0.3))  # fmt: skip
    with torch.no_grad():
        model.model.high_res_vision_alpha.fill_(0.7)
    model.save_pretrained(folder)
    DeepseekVLHybridImageProcessorPil(size={"height": 56, "width": 56},
                                      high_res_size={"height": 64, "width": 64}).save_pretrained(folder)  # fmt: skip
    return model


def deepseek_vl_hybrid_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `DeepseekVLHybridProcessor` inputs for `prompt` (16 image tokens an image; each image's low- and
    high-resolution views)."""
    from transformers import AutoImageProcessor, DeepseekVLHybridProcessor

    tokenizer, text, images = rendered(folder, prompt, DEEPSEEK_TEMPLATE)
    processor = DeepseekVLHybridProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                          num_image_tokens=16)  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_deepseek_vl_hybrid_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """DeepSeek-VL hybrid (an image's low-resolution view through SigLIP beside its high-resolution view through SAM,
    both through the hybrid aligner, `num_image_tokens` tokens an image): the prompt's ids are its processor's; prompts
    with one image, two and none, batched, whole and in chunks of 5, answer as transformers does."""
    model = save_deepseek_vl_hybrid(tmp_path)
    prompts = image_prompts()
    inputs = [deepseek_vl_hybrid_inputs(tmp_path, prompt) for prompt in prompts]
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_images_are_read_under_tensor_parallelism_as_on_one_rank(kind: str, tmp_path: Path) -> None:
    """Two ranks (rank 0 encodes; the encoder's rows, M-RoPE's positions, DeepStack's features and Gemma 3's two-way
    image blocks reach the other rank with each step): prompts with one image, two and none, batched, in chunks of 20,
    decoded through the decode graphs' padded path (every rank replaying its own, their rows' positions shifted after
    the images), answer as transformers does."""
    if kind == "gemma3":
        model, inputs_of = save_gemma3(tmp_path), gemma3_inputs
    else:
        model, inputs_of = save_qwen_vl(tmp_path, kind), qwen_inputs
    prompts = image_prompts()
    expected = [transformers_greedy(model, inputs_of(tmp_path, prompt)) for prompt in prompts]
    with engine(tmp_path, chunk=20, tensor_parallel_size=2) as llm:
        assert llm.core.runner.image_features is not None
        llm.core.runner.capture_decode_graphs(EagerCapture())
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
        replays = llm.core.runner.decode_graphs.replays
    assert [result.choices[0].token_ids for result in results] == expected
    assert sum(replays.values()) >= NEW_TOKENS - 1


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3"])
def test_a_text_draft_model_drafts_for_image_prompts(kind: str, tmp_path: Path) -> None:
    """Speculative decoding with a draft model that reads no images (a small Llama of the same tokenizer): the draft
    follows the target's steps as text (no image rows, M-RoPE positions or two-way blocks; its tokens' own positions),
    and the target's answers stay transformers'."""
    from tests.families import save_family

    if kind == "gemma3":
        model, inputs_of = save_gemma3(tmp_path / kind), gemma3_inputs
    else:
        model, inputs_of = save_qwen_vl(tmp_path / kind, kind), qwen_inputs
    draft = save_family(tmp_path / "draft", "llama")
    prompts = image_prompts()
    expected = [transformers_greedy(model, inputs_of(tmp_path / kind, prompt)) for prompt in prompts]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)}
    with engine(tmp_path / kind, chunk=20, speculative_config=spec) as llm:
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
    assert [result.choices[0].token_ids for result in results] == expected


# LLaVA-OneVision over a tiny SigLIP (tiles of 28 pixels: 4 x 4 patches of 7) beside a Qwen2 text model: an image
# alone in its prompt in tiles on its best grid up to 56 x 56 beside its base view, unpadded, a grid of more than about
# two tiles' features scaled down ("anyres_max_2"); each of a prompt's several images its base view alone.
_ONEVISION_SIGLIP = {**_GEMMA3_SIGLIP, "model_type": "siglip_vision_model", "image_size": 28, "patch_size": 7}
_ONEVISION_PROMPTS = {**PROMPTS, "wide image": lambda: user("And this one?", png(6, (90, 40))),
                      "one of the two alone": lambda: user("Only", png(3))}


def save_llava_onevision(folder: Path) -> Any:
    """A tiny LLaVA-OneVision checkpoint that reads images, saved in `folder` as transformers saves it; returns the
    model."""
    import transformers
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    image_token = vision_tokenizer(folder, ["<image>"], PARTS_BY_LOOP).convert_tokens_to_ids("<image>")
    text = {**_SHAPE, "model_type": "qwen2", "vocab_size": image_token + 8}
    config = transformers.LlavaOnevisionConfig(text_config=text, vision_config=_ONEVISION_SIGLIP,
                                               image_token_id=image_token, image_grid_pinpoints=_PINPOINTS,
                                               vision_aspect_ratio="anyres_max_2")  # fmt: skip
    model = save_drawn(folder, transformers.LlavaOnevisionForConditionalGeneration, config, wide_encoder, (0.08, 0.3))
    LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=_PINPOINTS).save_pretrained(
        folder
    )
    return model


def llava_onevision_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `LlavaOnevisionProcessor` inputs for `prompt` (its images as one prompt's, its video processor
    left out: it needs torchvision)."""
    from transformers import AutoImageProcessor, LlavaOnevisionProcessor

    class ImagesOnly(LlavaOnevisionProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
            return type(argument)

    tokenizer, text, images = rendered(folder, prompt, PARTS_BY_LOOP)
    processor = ImagesOnly(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer, video_processor=None,
                           num_image_tokens=16, vision_feature_select_strategy="full",
                           vision_aspect_ratio="anyres_max_2")  # fmt: skip
    inputs: dict[str, torch.Tensor] = processor(text=text, images=[images] if images else None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def test_a_llava_onevision_checkpoint_answers_image_prompts_as_transformers_does(tmp_path: Path) -> None:
    """LLaVA-OneVision (an image alone in its prompt in tiles on its best grid beside its base view, unpadded, scaled
    down past its `vision_aspect_ratio`, a newline embedding after each row; each of several images its base view and
    one newline): the prompt's ids are its processor's; prompts with one image, two and none, batched, whole and in
    chunks of 5, answer as transformers does; an image alone and among several, in flight together, is encoded for
    each."""
    model = save_llava_onevision(tmp_path)
    prompts = [*(_ONEVISION_PROMPTS[case]() for case in sorted(_ONEVISION_PROMPTS)),
               ChatPrompt([ChatMessage("user", "No picture here.")])]  # fmt: skip
    inputs = [llava_onevision_inputs(tmp_path, prompt) for prompt in prompts]
    image_token = model.config.image_token_id
    counts = [each["input_ids"][0].tolist().count(image_token) for each in inputs]
    assert inputs[0]["pixel_values"].shape[1] > 2  # (an image of several tiles beside its base view)
    assert counts[0] == 16 + 4 * 6 + 4  # (its 2 x 2 tiles' 8 x 8 patches unpadded to 6 x 8, scaled to 4 x 6)
    assert counts[3] == 2 * (16 + 1)  # (two images: each its base view's 16 and a newline)
    assert_serves_like(tmp_path, model, prompts, inputs, (2048, 5))
