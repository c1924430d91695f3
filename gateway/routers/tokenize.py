"""vLLM's `POST /tokenize` and `POST /detokenize` (and `GET /version`): what the engine's tokenizer makes of a
prompt or a conversation (rendered with the model's chat template, as a chat request would be), and the text of
token ids. The engine does both (Tokenize, Detokenize): the gateway holds no tokenizer."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pydantic
from fastapi import APIRouter, Depends

from gateway import calls
from gateway.deps import CallId, Media, Pool, require_api_key, served_or_default
from gateway.errors import invalid, invalid_body
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.tokenize import DetokenizeRequest, TokenizeRequest
from gateway.translate import to_engine
from gateway.translate.media_parts import chat_media_sources
from ladle.v1 import engine_pb2, types_pb2

router = APIRouter(dependencies=[Depends(require_api_key)])
# `GET /version` answers without a key, as /health does.
version_router = APIRouter()


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, pool: Pool, rid: CallId, media: Media) -> Any:
    """`{"count", "max_model_len", "tokens", "token_strs"}` (the tokens' texts with `return_token_strs`)."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send exactly one of prompt and messages", "prompt")
    served = served_or_default(pool, body.model)
    request = engine_pb2.TokenizeRequest()
    if body.messages is not None:
        try:
            fields = {"model": served.id, "messages": body.messages, "tools": body.tools,
                      "chat_template_kwargs": body.chat_template_kwargs,
                      "continue_final_message": body.continue_final_message}
            if "add_generation_prompt" in body.model_fields_set:  # (unset: as the chat route reads it unset)
                fields["add_generation_prompt"] = body.add_generation_prompt
            chat = ChatCompletionRequest.model_validate(fields)
        except pydantic.ValidationError as exc:
            raise invalid_body(exc) from None
        images = await media.fetch(chat_media_sources(chat.messages))
        request.input.CopyFrom(to_engine.chat_request(chat, chat.messages, rid, images=images).input)
    else:
        request.input.CopyFrom(types_pb2.Input(text=body.prompt or ""))
        request.add_special_tokens = body.add_special_tokens is not False
    reply = await calls.tokenize(pool, request)
    info = pool.model_info()
    return {"count": len(reply.token_ids), "max_model_len": info.context_length if info is not None else None,
            "tokens": list(reply.token_ids), "token_strs": list(reply.tokens) if body.return_token_strs else None}


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, pool: Pool) -> Any:
    """`{"prompt": text}` of the token ids."""
    served_or_default(pool, body.model)
    reply = await calls.detokenize(pool, engine_pb2.DetokenizeRequest(token_ids=body.tokens))
    return {"prompt": reply.text}


@version_router.get("/version", response_model=None)
async def version() -> Any:
    return {"version": metadata.version("ladle")}
