"""What a request constrains its output to: one formal language, given as data, and its validation.

A `Constraint` is plain immutable data (hashable, so it is its own compile-cache key). Compiling it is the
job of `engine_server.structured.compiler`; this module never imports xgrammar.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine_server.errors import ValidationError

# Documented caps, checked before any compile work: a spec above them is refused with a ValidationError.
MAX_SPEC_CHARS = 256 * 1024  # schema / regex / grammar text, or all choices together
MAX_CHOICES = 1024
# JSON nesting levels of a schema (`{}` and `[]` count one each). xgrammar's work grows about with the cube of
# the depth: 128 levels convert and compile in ~0.2 s, 900 levels take ~40 s of CPU.
MAX_SCHEMA_DEPTH = 128


class ConstraintKind(enum.Enum):
    """The kind of language; the values are the proto `Constraint` oneof field names."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; no spec
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: an EBNF grammar (GBNF dialect) whose root rule is "root"


@dataclass(frozen=True)
class Constraint:
    """One constraint on a request's output. Build it with the class methods; check it with `validate()`.

    `spec` is the schema / regex / grammar text ("" for json_object and choice); `choices` is used by
    choice only. The output of a constrained request is a complete sentence of the language when it ends
    with `stop`; it may be cut short only by max_tokens (`length`) or a stop string.
    """

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    # A thinking model's reasoning comes first, free, and the language constrains what follows its </think>
    # (engine_server.reasoning): "inside" when the prompt opened <think>, "if_opened" when the output may open it
    # (or answer at once). "" constrains the whole output, unless the engine splits a reasoning off, which then
    # sets one of those; "none" constrains the whole output in any case (a grammar that spells the reasoning too);
    # "harmony" (gpt-oss) constrains the body of the final channel's message, after at most one free analysis one.
    after_reasoning: str = ""
    # The (opening, closing) tags of that reasoning: <think> and </think>, or a family's own (Seed-OSS, Magistral);
    # then, for a family that wraps its answer in markers (Cohere's <|START_RESPONSE|>, <|END_RESPONSE|>), those two:
    # the constrained answer may stand between them.
    reasoning_tags: tuple[str, ...] = ("<think>", "</think>")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any]) -> Constraint:
        """A JSON Schema, as JSON text or a mapping (kept in its key order: properties come out in it)."""
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> Constraint:
        return cls(ConstraintKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, ebnf)

    def after(self, reasoning: str, tags: tuple[str, ...] = ("<think>", "</think>")) -> Constraint:
        """This constraint on what follows a reasoning that starts as `reasoning` says (see `after_reasoning`),
        written between `tags`."""
        return dataclasses.replace(self, after_reasoning=reasoning, reasoning_tags=tags)

    @property
    def param(self) -> str:
        """The request field this constraint came from, for ValidationError.param (the proto field name)."""
        return self.kind.value

    def validate(self) -> None:
        """Raise ValidationError on a malformed constraint. Cheap: it checks shape, not compilability."""
        if self.after_reasoning not in ("", "inside", "if_opened", "none", "harmony"):
            raise ValidationError(f"unknown after_reasoning {self.after_reasoning!r}", param="constraint")
        if len(self.reasoning_tags) not in (2, 4) or not all(isinstance(t, str) and t for t in self.reasoning_tags):
            raise ValidationError("reasoning_tags must be two or four non-empty strings", param="constraint")
        if not isinstance(self.kind, ConstraintKind):
            raise ValidationError(f"unknown constraint kind {self.kind!r}", param="constraint")
        if self.kind is ConstraintKind.CHOICE:
            self._validate_choices()
            return
        if self.choices:
            raise ValidationError(f"a {self.kind.value} constraint takes no choices", param=self.param)
        if self.kind is ConstraintKind.JSON_OBJECT:
            if self.spec:
                raise ValidationError("a json_object constraint takes no spec", param=self.param)
            return
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValidationError(f"{self.kind.value} must be a non-empty string", param=self.param)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValidationError(
                f"{self.kind.value} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS} are allowed",
                param=self.param,
            )
        if self.kind is ConstraintKind.JSON_SCHEMA:
            _check_schema_text(self.spec)

    def _validate_choices(self) -> None:
        if self.spec:
            raise ValidationError("a choice constraint takes no spec", param=self.param)
        if not self.choices:
            raise ValidationError("choice must list at least one option", param=self.param)
        if len(self.choices) > MAX_CHOICES:
            raise ValidationError(
                f"choice lists {len(self.choices)} options; at most {MAX_CHOICES} are allowed", param=self.param
            )
        if not all(isinstance(c, str) and c for c in self.choices):
            raise ValidationError("every choice must be a non-empty string", param=self.param)
        if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
            raise ValidationError(f"choices exceed {MAX_SPEC_CHARS} characters in all", param=self.param)


def _check_schema_text(text: str) -> None:
    """A JSON Schema must be a JSON object (or a boolean schema) at most MAX_SCHEMA_DEPTH levels deep; anything
    else fails before compiling."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"json_schema is not valid JSON: {exc}", param="json_schema") from exc
    except RecursionError:  # deeper than the parser's stack allows: far beyond MAX_SCHEMA_DEPTH
        raise ValidationError(
            f"json_schema is nested too deeply; at most {MAX_SCHEMA_DEPTH} levels are allowed", param="json_schema"
        ) from None
    if not isinstance(schema, dict | bool):
        raise ValidationError(f"json_schema must be a JSON object, got {type(schema).__name__}", param="json_schema")
    check_schema_depth(schema, "json_schema")


def check_schema_depth(schema: Any, param: str) -> None:
    """Raise ValidationError (naming `param`) if parsed JSON `schema` nests deeper than MAX_SCHEMA_DEPTH."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValidationError(
            f"{param} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed", param=param
        )


def json_depth(value: Any) -> int:
    """The nesting depth of parsed JSON: 0 for a scalar, 1 for a flat object or array. Iterative, so a value
    of any depth is measured without exhausting Python's stack."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, Mapping):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
