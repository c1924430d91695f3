"""Structured output: constraints (JSON schema, any JSON object, regex, choice, EBNF) compiled with xgrammar.

This package root stays light (no xgrammar import) because `SamplingParams` carries a `Constraint`:
- `constraint` — the `Constraint` a request asks for, and its validation.
- `compiler` — `GrammarCompiler`, the off-step-loop compile service (worker threads, cache, time limit).
- `matchers` — `GrammarMatchers`, the runner's per-request matcher state and per-step token bitmasks.
"""

from __future__ import annotations

from engine_server.structured.constraint import Constraint, ConstraintKind

__all__ = ["Constraint", "ConstraintKind"]
