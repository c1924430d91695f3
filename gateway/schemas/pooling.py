"""`POST /v1/embeddings`, `/v1/score` and `/v1/rerank` bodies: OpenAI's embeddings request with vLLM's extras, and
vLLM's score and rerank requests (Jina / Cohere compatible).

Only shapes are checked here; what a body means (which score fields pair up, an empty input, a value the engine's
request cannot carry) is checked by `translate.pooling_to_engine`, which names the field in its 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from gateway.schemas.chat import ChatMessage
from gateway.schemas.common import IGNORE_EXTRA, UINT32_MAX

# An embeddings input: one string, several strings, one token-id list, or several token-id lists (OpenAI's forms).
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
MAX_POOLING_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request; documents per score/rerank too
# vLLM's truncate_prompt_tokens: -1 is the model's context length, k >= 1 keeps an input's last k tokens.
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=UINT32_MAX)]


def _one_of(kinds: str, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`handler(value)`, its failure as one error on the field itself: a union's per-member errors would name a
    member (`input.str`) rather than the field."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"must be {kinds}") from None


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body; `messages` in place of `input` is vLLM's chat embedding (one conversation, rendered
    with the chat template, one vector). `normalize` (and vLLM's newer name for it, `use_activation`) unset: the
    model's own default."""

    model_config = IGNORE_EXTRA
    model: str
    input: EmbeddingInput | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    user: str | None = None
    # vLLM extras.
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _one_of("a string, a list of strings, a list of token ids or a list of token-id lists", value, handler)

    def inputs(self) -> list[str | list[int]]:
        """`input` as a list of independent inputs (strings or token-id lists)."""
        value = self.input
        if value is None or isinstance(value, str):
            return [] if value is None else [value]
        if value and all(isinstance(v, int) for v in value):
            return [[v for v in value if isinstance(v, int)]]
        return [v for v in value if not isinstance(v, int)]


ScoreText = str | list[str]
# vLLM's names for the two sides of a score request, newest first: (first side, second side).
SCORE_FIELD_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(BaseModel):
    """vLLM's score body: one pair of sides (`text_1`/`text_2`, or `queries` with `documents` or `items`, or
    `data_1`/`data_2`), each a string or a list. 1 vs N scores the one first-side text against each of the second
    side's; N vs N scores them element-wise. `model` unset: the served model."""

    model_config = IGNORE_EXTRA
    model: str | None = None
    text_1: ScoreText | None = None
    text_2: ScoreText | None = None
    queries: ScoreText | None = None
    documents: ScoreText | None = None
    items: ScoreText | None = None
    data_1: ScoreText | None = None
    data_2: ScoreText | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    user: str | None = None

    @field_validator("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2", mode="wrap")
    @classmethod
    def _side(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _one_of("a string or a list of strings", value, handler)

    def sides(self) -> list[tuple[str, str]]:
        """The (first, second) field-name pairs of SCORE_FIELD_PAIRS whose two sides are both set."""
        return [(a, b) for a, b in SCORE_FIELD_PAIRS if getattr(self, a) is not None and getattr(self, b) is not None]


class RerankDocument(BaseModel):
    """A document given as an object (Jina's and Cohere v1's form): only its text is read."""

    model_config = IGNORE_EXTRA
    text: str


class RerankRequest(BaseModel):
    """vLLM's rerank body (Jina / Cohere compatible): `top_n` 0 or unset returns every document, best first;
    `return_documents` echoes each document's text (vLLM always does; false leaves it out, as Cohere does)."""

    model_config = IGNORE_EXTRA
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    return_documents: bool = True
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    user: str | None = None

    @field_validator("documents", mode="wrap")
    @classmethod
    def _documents(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _one_of("a list of strings, or of objects with a `text` string", value, handler)

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
