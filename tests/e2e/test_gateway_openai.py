"""The official OpenAI SDK against real `ladle gateway` + `ladle engine` processes: every route and parameter."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _engine_chat_text(stub: engine_pb2_grpc.EngineServiceStub, content: str, max_tokens: int) -> str:
    request = engine_pb2.GenerateRequest(
        input=types_pb2.Input(chat=types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content=content)])),
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    return stub.Generate(request, timeout=120).choices[0].text


def test_models_list_and_retrieve(openai_client: openai.OpenAI, model_id: str) -> None:
    assert model_id == "SmolLM2-135M-Instruct"
    assert openai_client.models.retrieve(model_id).id == model_id


def test_chat_greedy_matches_the_engine(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub
) -> None:
    reply = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == _engine_chat_text(stub, QUESTION[0]["content"], 24)
    assert choice.finish_reason in {"stop", "length"}
    assert reply.object == "chat.completion" and reply.model == model_id
    usage = reply.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 24


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_joins_to_the_whole_answer(
    openai_client: openai.OpenAI, model_id: str, include_usage: bool
) -> None:
    whole = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(openai_client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=24, temperature=0, stream=True, **options
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_chat_n_and_seed(openai_client: openai.OpenAI, model_id: str) -> None:
    def ask(seed: int) -> list[str]:
        reply = openai_client.chat.completions.create(
            model=model_id, messages=QUESTION, max_tokens=16, temperature=1.0, n=3, seed=seed
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.message.content or "" for c in reply.choices]

    first = ask(7)
    assert ask(7) == first
    assert len(set(first)) > 1  # the choices are sampled independently
    assert ask(8) != first


def test_chat_stream_n_choices(openai_client: openai.OpenAI, model_id: str) -> None:
    chunks = list(openai_client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=8, temperature=1.0, n=2, seed=1, stream=True
    ))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = openai_client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=8, temperature=1.0, n=2, seed=1
    )
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_stop_sequences(openai_client: openai.OpenAI, model_id: str) -> None:
    whole = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content or ""
    word = text.split()[2]
    stopped = openai_client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=24, temperature=0, stop=[word, "zzzz"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(word)]


def test_logprobs(openai_client: openai.OpenAI, model_id: str) -> None:
    reply = openai_client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the best
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_max_completion_tokens_ignore_eos_and_min_tokens(openai_client: openai.OpenAI, model_id: str) -> None:
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hi."}], max_completion_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].finish_reason == "length"


def test_completions_prompt_forms(openai_client: openai.OpenAI, model_id: str) -> None:
    one = openai_client.completions.create(model=model_id, prompt="The sky is", max_tokens=6, temperature=0)
    assert one.object == "text_completion" and len(one.choices) == 1
    several = openai_client.completions.create(
        model=model_id, prompt=["The sky is", "Paris is"], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == one.choices[0].text
    assert several.usage is not None and 4 <= several.usage.completion_tokens <= 4 * 6
    ids = openai_client.completions.create(model=model_id, prompt=[1, 504, 3384, 314], max_tokens=4, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    id_lists = openai_client.completions.create(
        model=model_id, prompt=[[1, 504], [1, 3384, 314]], max_tokens=4, temperature=0
    )
    assert id_lists.usage is not None and id_lists.usage.prompt_tokens == 5
    assert len(id_lists.choices) == 2


def test_completions_stream_echo_and_logprobs(openai_client: openai.OpenAI, model_id: str) -> None:
    whole = openai_client.completions.create(
        model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2
    )
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 8
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    chunks = list(openai_client.completions.create(
        model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True, echo=True
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Once upon a time" + whole.choices[0].text
    echoed = openai_client.completions.create(
        model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Once upon a time" + whole.choices[0].text


def test_batched_chat_endpoint(gateway_http: httpx.Client, model_id: str, openai_client: openai.OpenAI) -> None:
    conversations = [
        [{"role": "user", "content": f"Name a {thing}."}] for thing in ("color", "fruit", "city", "planet", "animal")
    ]
    reply = gateway_http.post("/v1/chat/completions/batch", json={
        "model": model_id, "messages": conversations, "max_tokens": 12, "temperature": 0,
    })
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == list(range(5))
    singles = [
        openai_client.chat.completions.create(model=model_id, messages=c, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        for c in conversations
    ]
    assert [c["message"]["content"] for c in body["choices"]] == [s.choices[0].message.content for s in singles]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(getattr(s.usage, key) for s in singles)


def test_structured_output_and_extras(openai_client: openai.OpenAI, model_id: str) -> None:
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        max_tokens=5, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].message.content in {"yes", "no"}
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Give a number."}],
        max_tokens=8, temperature=0, extra_body={"regex": "[0-9]{3}"},
    )
    assert reply.choices[0].message.content is not None and len(reply.choices[0].message.content) == 3


def test_beam_search_as_vllm_takes_it(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub, gateway_http: httpx.Client
) -> None:
    """vLLM's `use_beam_search` (n beams, the n best answered; best_of beams on /v1/completions) answers the beams a
    gRPC caller gets with beam_width, whole or streamed; what beam search does not serve is a 400 naming it."""
    beams = {"use_beam_search": True, "length_penalty": 0.8}
    reply = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=12, n=3,
                                                  extra_body=beams)  # fmt: skip
    texts = [c.message.content for c in reply.choices]
    message = types_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])
    request = engine_pb2.GenerateRequest(
        input=types_pb2.Input(chat=types_pb2.ChatInput(messages=[message])),
        sampling=types_pb2.SamplingParams(max_tokens=12, beam_width=3, n=3, length_penalty=0.8),
    )
    assert texts == [c.text for c in stub.Generate(request, timeout=120).choices]
    assert len(set(texts)) == 3
    assert reply.usage is not None and reply.usage.completion_tokens == sum(
        len(c.token_ids) for c in stub.Generate(request, timeout=120).choices)
    chunks = list(openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=12, n=3,
                                                        stream=True, extra_body=beams))  # fmt: skip
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]  # fmt: skip
    assert streamed == texts
    best = openai_client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, n=1,
                                            best_of=3, extra_body={"use_beam_search": True})  # fmt: skip
    three = openai_client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, n=3,
                                             extra_body={"use_beam_search": True})  # fmt: skip
    assert [c.text for c in best.choices] == [three.choices[0].text]
    refused = gateway_http.post("/v1/chat/completions", json={"model": model_id, "messages": QUESTION, "n": 2,
                                                              "use_beam_search": True, "stop": ["."]})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
    below = gateway_http.post("/v1/completions", json={"model": model_id, "prompt": "Hi", "n": 3, "best_of": 2})
    assert below.status_code == 400 and below.json()["error"]["param"] == "best_of"
    wide = gateway_http.post("/v1/completions", json={"model": model_id, "prompt": "Hi", "best_of": 17,
                                                      "use_beam_search": True})  # fmt: skip
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "best_of"


def test_continue_final_message_goes_on_from_the_last_message(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub, gateway_http: httpx.Client
) -> None:
    """vLLM's continue_final_message (with add_generation_prompt false, as vLLM's docs send it, or unset): the answer
    continues the assistant turn the caller began, as the same tokens given as a completions prompt continue."""
    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    messages = [types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in begun]
    chat = types_pb2.ChatInput(messages=messages, add_generation_prompt=False, continue_final_message=True)
    rendered = stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(chat=chat)), timeout=60)
    assert rendered.prompt_text.endswith("<|im_start|>assistant\nThe capital of France is")
    continued = openai_client.completions.create(model=model_id, prompt=list(rendered.token_ids), max_tokens=12,
                                                 temperature=0)  # fmt: skip
    for extra in ({"continue_final_message": True, "add_generation_prompt": False}, {"continue_final_message": True}):
        reply = openai_client.chat.completions.create(model=model_id, messages=begun, max_tokens=12,  # type: ignore[arg-type]
                                                      temperature=0, extra_body=extra)  # fmt: skip
        assert reply.choices[0].message.content == continued.choices[0].text
        assert reply.usage is not None and reply.usage.prompt_tokens == len(rendered.token_ids)
    # vLLM's echo: the answer starts with the assistant turn the caller began, whole or streamed.
    echoed = openai_client.chat.completions.create(model=model_id, messages=begun, max_tokens=12,  # type: ignore[arg-type]
                                                   temperature=0, extra_body={"continue_final_message": True,
                                                                              "echo": True})  # fmt: skip
    assert echoed.choices[0].message.content == "The capital of France is" + continued.choices[0].text
    chunks = list(openai_client.chat.completions.create(model=model_id, messages=begun, max_tokens=12,  # type: ignore[arg-type]
                                                        temperature=0, stream=True, extra_body={
                                                            "continue_final_message": True, "echo": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content
    asked = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4, temperature=0,
                                                  extra_body={"echo": True})  # fmt: skip
    plain = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4, temperature=0)
    assert asked.choices[0].message.content == plain.choices[0].message.content  # (a user turn last: nothing echoed)
    both = gateway_http.post("/v1/chat/completions", json={"model": model_id, "messages": begun, "max_tokens": 4,
                                                           "continue_final_message": True,
                                                           "add_generation_prompt": True})  # fmt: skip
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
    counted = gateway_http.post("/tokenize", json={"model": model_id, "messages": begun,
                                                   "continue_final_message": True})  # fmt: skip
    assert counted.json()["tokens"] == list(rendered.token_ids)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub
) -> None:
    """vLLM's truncate_prompt_tokens on completions and chat: the answer is the one to the prompt's last k tokens
    (a chat's once rendered), and usage counts those k."""
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    ids = list(stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(text=prompt)), timeout=60).token_ids)
    cut = openai_client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"truncate_prompt_tokens": 6})  # fmt: skip
    last = openai_client.completions.create(model=model_id, prompt=ids[-6:], max_tokens=8, temperature=0)
    assert cut.choices[0].text == last.choices[0].text
    assert cut.usage is not None and cut.usage.prompt_tokens == 6
    chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])])
    rendered = list(stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(chat=chat)), timeout=60).token_ids)
    reply = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=8, temperature=0,
                                                  extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    tail = openai_client.completions.create(model=model_id, prompt=rendered[-5:], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == tail.choices[0].text
    assert reply.usage is not None and reply.usage.prompt_tokens == 5


def test_allowed_token_ids_are_the_only_tokens_sampled(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub, gateway_http: httpx.Client
) -> None:
    """vLLM's allowed_token_ids: every generated token is one of them, sampled or greedy; an empty list is a 400."""
    words = stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(text=" yes no maybe"),
                                                     add_special_tokens=False), timeout=60)  # fmt: skip
    allowed = list(words.token_ids)
    for temperature in (0.0, 1.0):
        reply = gateway_http.post("/v1/chat/completions", json={
            "model": model_id, "messages": QUESTION, "max_tokens": 6, "temperature": temperature, "n": 2,
            "allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}).json()  # fmt: skip
        for choice in reply["choices"]:
            assert choice["token_ids"] and set(choice["token_ids"]) <= set(allowed), choice
    empty = gateway_http.post("/v1/chat/completions", json={"model": model_id, "messages": QUESTION,
                                                            "allowed_token_ids": []})  # fmt: skip
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_generated(openai_client: openai.OpenAI, model_id: str) -> None:
    """vLLM's bad_words: a word the greedy answer holds is kept out of it."""
    import re

    plain = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0)
    word = next(w for w in re.findall(r"[A-Za-z]{4,}", plain.choices[0].message.content or ""))
    barred = openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0,
                                                   extra_body={"bad_words": [word]})  # fmt: skip
    assert barred.choices[0].message.content and word not in re.findall(r"[A-Za-z]+", barred.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4,
                                              extra_body={"bad_words": ["x"] * 17})  # fmt: skip
    assert refused.value.body["param"] == "bad_words"  # type: ignore[index]


def test_best_of_answers_the_likeliest_of_its_samples(openai_client: openai.OpenAI, model_id: str) -> None:
    """OpenAI's best_of on completions (no beam search): best_of seeded samples, the n with the best mean token
    log-probability answered, best first, in the order their mean log-probabilities give; usage counts every sample."""
    prompt = "Once upon a time"
    every = openai_client.completions.create(model=model_id, prompt=prompt, max_tokens=10, n=4, seed=5, logprobs=0)
    best = openai_client.completions.create(model=model_id, prompt=prompt, max_tokens=10, n=2, best_of=4, seed=5,
                                            logprobs=0)  # fmt: skip

    def mean(choice: Any) -> float:
        found = choice.logprobs.token_logprobs
        return sum(found) / len(found)

    ranked = sorted(every.choices, key=mean, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage is not None and every.usage is not None
    assert best.usage.completion_tokens == every.usage.completion_tokens
