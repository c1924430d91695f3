"""Audio as input on the CPU: a random Qwen2-Audio checkpoint (a 0.5B-class text model, Qwen2.5-0.5B's shape, beside an
8-layer Whisper-style tower 512 wide; 10-second clips, 250 tokens each) served by the engine, on the float path and on
its int8 default, and by transformers' own model in the same run: one request (a clip and a question, 64 new tokens)
start to end and to its first token, and 4 such requests with different clips at once (the engine batches them;
transformers runs them one after another, as its `generate` takes one conversation at a time here). The float path's
greedy tokens must equal transformers' (the script fails otherwise).

    PYTHONPATH=. .venv/bin/python -m benchmarks.audio_input_cpu --out benchmarks/results/audio_input_cpu.jsonl
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import media_input
from benchmarks.common import append_result
from benchmarks.vl_checkpoints import save_drawn, vision_tokenizer

NEW = 64
SECONDS = 10.0  # a clip: 1,000 mel frames, 250 tokens after the tower's stride and pooling
RATE = 16_000
TEXT = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "rope_theta": 1e6}  # fmt: skip
TOWER = {"d_model": 512, "encoder_layers": 8, "encoder_attention_heads": 8, "encoder_ffn_dim": 2048,
         "num_mel_bins": 128}  # fmt: skip
MARKS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
    "{% if part['type'] == 'audio' %}Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "What is said in this recording, and by whom?"


def recording(seed: int) -> bytes:
    """A random SECONDS-long clip (tones and noise) as a 16 kHz mono WAV file."""
    import numpy as np
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(SECONDS * RATE)) / RATE
    wave = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 2000, 4)) * 0.2
    out = io.BytesIO()
    soundfile.write(out, (wave + 0.05 * rng.standard_normal(t.shape[0])).astype(np.float32), RATE, format="WAV")
    return out.getvalue()


def save_checkpoint(folder: Path) -> None:
    """The benchmark's random Qwen2-Audio checkpoint in `folder`."""
    import transformers
    from transformers import WhisperFeatureExtractor

    tokenizer = vision_tokenizer(folder, MARKS, TEMPLATE)
    audio_token = int(tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    config = transformers.Qwen2AudioConfig(audio_config=TOWER, text_config={**TEXT, "vocab_size": audio_token + 8},
                                           audio_token_index=audio_token)  # fmt: skip
    save_drawn(folder, transformers.Qwen2AudioForConditionalGeneration, config, lambda name: False, (0.05, 0.05))
    WhisperFeatureExtractor(feature_size=128).save_pretrained(folder)


def prompt(clip: bytes) -> Any:
    """The benchmark's chat: the clip, then the question."""
    from engine_server.frontend import ChatPrompt
    from engine_server.tokenizer.chat import ChatAudio, ChatMessage

    return ChatPrompt([ChatMessage("user", content_parts=(ChatAudio(clip), QUESTION))])


def transformers_run(folder: Path, clips: list[bytes]) -> dict[str, Any]:
    """transformers' timings over `clips` (`media_input.transformers_run`)."""
    import numpy as np
    import soundfile
    import torch
    import transformers
    from transformers import AutoFeatureExtractor, AutoTokenizer

    processor = transformers.Qwen2AudioProcessor(AutoFeatureExtractor.from_pretrained(folder),
                                                 AutoTokenizer.from_pretrained(folder), chat_template=TEMPLATE)
    model: Any = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    turn: Any = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)

    def generate(clip: bytes, new: int) -> list[int]:
        samples, _ = soundfile.read(io.BytesIO(clip), dtype="float32")
        inputs = processor(text=text, audio=[np.asarray(samples)], sampling_rate=RATE, return_tensors="pt",
                           add_special_tokens=False)  # fmt: skip
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]

    return media_input.transformers_run(generate, clips, recording(99), NEW)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="requests at once, each with its own clip")
    parser.add_argument("--out", type=Path, help="append the results to this JSONL file")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.audio_input_cpu" + (f" --out {args.out}" if args.out else "")
    clips = [recording(seed) for seed in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "qwen2_audio"
        save_checkpoint(folder)
        peer = transformers_run(folder, clips)
        runs = media_input.compared_runs(folder, peer, [prompt(clip) for clip in clips], prompt(recording(99)), NEW)
    if runs is None:
        return 1
    result = media_input.result_record(
        "audio_input_cpu", command, runs, args.requests, NEW, model="qwen2_audio", text_shape=TEXT, tower_shape=TOWER,
        weights="random", clip_seconds=SECONDS,
    )  # fmt: skip
    print(result)
    if args.out:
        append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
