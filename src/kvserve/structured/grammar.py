"""StructuredOutput -> an llguidance grammar (a JSON string LLMatcher takes), validated.

Compiling is cached by content (an LRU keyed by the frozen StructuredOutput, whose fields are
the serialized schema, regex, choices or grammar): the server validates a request's grammar on
a tokenizer thread and the engine thread then finds it compiled.  An invalid grammar is a
ParameterError naming the request field it came from, with llguidance's reason.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from kvserve.errors import ParameterError
from kvserve.request import StructuredOutput

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (a grammar string is a few KiB)
MAX_REASON_CHARS = 400  # llguidance's messages can quote a whole grammar
# Compact JSON (`{"a":1,"b":[2,3]}`): no whitespace between tokens, so a small model cannot
# spend its max_tokens on indentation; a schema's "x-guidance" options override it.
JSON_OPTIONS = {"whitespace_flexible": False}


def kind_of(so: StructuredOutput) -> str:
    """The constraint's kind: json, json_object, regex, choice or grammar."""
    kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    kinds += ["json_object"] if so.json_object else []
    if len(kinds) != 1:
        raise ParameterError(
            so.source,
            f"must set exactly one of json, regex, choice, grammar; got {kinds or 'none'}",
        )
    return kinds[0]


def field_of(so: StructuredOutput) -> str:
    """The request field an error names: `source` when it already names the constraint
    (response_format.json_schema.schema, guided_regex), else source.kind."""
    kind = kind_of(so)
    if "." in so.source or so.source.startswith("guided_") or kind == "json_object":
        return so.source
    return f"{so.source}.{kind}"


def lark_of_choices(choices: tuple[str, ...]) -> str:
    """A Lark grammar whose language is exactly `choices` (JSON string literals: llguidance's
    Lark reads their escapes)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def looks_like_gbnf(text: str) -> bool:
    return "::=" in text


def _grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of `so`, not yet validated; ParameterError for what is wrong
    before llguidance reads it (an empty choice list, a schema that is not JSON)."""
    kind, field = kind_of(so), field_of(so)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json":
        try:
            schema: Any = json.loads(so.json) if isinstance(so.json, str) else so.json
        except json.JSONDecodeError as exc:
            raise ParameterError(field, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ParameterError(field, "must be a JSON schema (an object)")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ParameterError(field, f"is not a valid JSON schema: {_short(exc)}") from None
    if kind == "regex":
        if not so.regex:
            raise ParameterError(field, "must be a non-empty regular expression")
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        if not so.choice or not all(isinstance(c, str) and c for c in so.choice):
            raise ParameterError(field, "must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark(lark_of_choices(so.choice))
    text = so.grammar or ""
    if not text.strip():
        raise ParameterError(field, "must be a non-empty grammar (Lark or GBNF)")
    if looks_like_gbnf(text):
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter raises its own parse errors
            raise ParameterError(field, f"is not a valid GBNF grammar: {_short(exc)}") from None
    return LLMatcher.grammar_from_lark(text)


def _short(reason: object) -> str:
    text = str(reason).strip()
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


class GrammarCompiler:
    """Compiles and validates StructuredOutputs against one tokenizer, keeping each one's
    grammar and a matcher at its start (copied for every sequence); thread-safe (functools'
    LRU is; llguidance releases the GIL while it compiles)."""

    def __init__(self, tokenizer: LLTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)

    def compile(self, so: StructuredOutput) -> str:
        """The validated llguidance grammar of `so`; ParameterError naming its field."""
        return self._compiled(so)[0]

    def matcher(self, so: StructuredOutput) -> LLMatcher:
        """A fresh matcher of `so` at its start: a copy of the cached one (~10 us, where
        building one compiles the grammar against the vocabulary: ~1-3 ms for a schema)."""
        template = self._compiled(so)[1]
        assert template is not None, "a compiler without a tokenizer only validates"
        return template.deep_copy()

    def _compiled(self, so: StructuredOutput) -> tuple[str, LLMatcher | None]:
        result = self._compile(so)
        if isinstance(result, ParameterError):
            raise ParameterError(result.param, result.reason)
        return result

    def _compile_uncached(
        self, so: StructuredOutput
    ) -> tuple[str, LLMatcher | None] | ParameterError:
        """The grammar and a matcher at its start (never advanced: only copied), or the
        error (cached too: a client retrying a bad schema costs one lookup)."""
        try:
            text = _grammar_text(so)
        except ParameterError as exc:
            return exc
        if self.tokenizer is None:
            error = LLMatcher.validate_grammar(text)
            return ParameterError(field_of(so), f"is invalid: {_short(error)}") if error else (
                text, None)  # fmt: skip
        template = LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            return ParameterError(field_of(so), f"is invalid: {_short(template.get_error())}")
        return text, template
