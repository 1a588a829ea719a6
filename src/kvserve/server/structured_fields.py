"""Request fields that constrain the output -> StructuredOutput, and its validation.

    response_format      {"type": "text"} | {"type": "json_object"} |
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older fields

At most one constraint a request (400 naming the second field).  Parsing is plain Python on
the event loop (O(size of the fields)); compiling and validating the grammar with llguidance
runs on a tokenizer thread (`validate_structured`), cached by content and shared with the
engine, whose thread then finds the grammar compiled.  Every error is a 400 naming the field
(response_format.json_schema.schema, structured_outputs.regex, guided_grammar, ...) with
llguidance's reason.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.errors import ParameterError
from kvserve.request import StructuredOutput
from kvserve.server.errors import APIError
from kvserve.server.protocol import SamplingRequest
from kvserve.server.tokenization import ServerTokenizers

STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output_of(request: SamplingRequest) -> StructuredOutput | None:
    """The request's one constraint, or None; APIError (400) naming the field."""
    found: list[StructuredOutput] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        so = _from_response_format(response_format)
        found += [so] if so is not None else []
    if request.structured_outputs is not None:
        found.append(_from_structured_outputs(request.structured_outputs))
    for name in GUIDED_FIELDS:
        value = getattr(request, name)
        if value is not None:
            found.append(_from_value(name.removeprefix("guided_"), value, name))
    if len(found) > 1:
        names = ", ".join(_field_name(so) for so in found)
        raise APIError(
            f"{_field_name(found[1])}: only one output constraint is allowed per request, "
            f"got {names}",
            _field_name(found[1]),
        )
    return found[0] if found else None


def _field_name(so: StructuredOutput) -> str:
    return so.source


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise APIError("response_format must be an object with a 'type'", "response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, source="response_format")
    if kind != "json_schema":
        raise APIError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{str(kind)[:40]!r}",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(
            "response_format.json_schema must be an object with 'name' and 'schema'",
            "response_format.json_schema",
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(
            "response_format.json_schema.schema must be a JSON schema (an object)",
            "response_format.json_schema.schema",
        )
    return StructuredOutput(json=json.dumps(schema), source="response_format.json_schema.schema")


def _from_structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise APIError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(str(k)[:40] for k in value if k not in STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise APIError(
            f"structured_outputs.{unknown[0]} is not supported; use one of "
            f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}",
            f"structured_outputs.{unknown[0]}",
        )
    present = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(present) != 1:
        raise APIError(
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, "
            f"got {present or 'none'}",
            "structured_outputs",
        )
    key = present[0]
    return _from_value(key, value[key], f"structured_outputs.{key}")


def _from_value(kind: str, value: Any, field: str) -> StructuredOutput:
    """One constraint of `kind` from a request value (JSON types checked here)."""
    if kind == "json_object":
        if value is not True:
            raise APIError(f"{field} must be true", field)
        return StructuredOutput(json_object=True, source=field)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(f"{field} is not valid JSON: {exc}", field) from None
        if not isinstance(value, dict):
            raise APIError(f"{field} must be a JSON schema (an object)", field)
        return StructuredOutput(json=json.dumps(value), source=field)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise APIError(f"{field} must be a non-empty list of non-empty strings", field)
        return StructuredOutput(choice=tuple(value), source=field)
    if not isinstance(value, str) or not value:
        raise APIError(f"{field} must be a non-empty string", field)
    if kind == "regex":
        return StructuredOutput(regex=value, source=field)
    return StructuredOutput(grammar=value, source=field)


async def validate_structured(
    so: StructuredOutput, tokenizers: ServerTokenizers, compile_fn: Any
) -> None:
    """Compile and validate `so` on a tokenizer thread: `compile_fn(so, tokenizer)` (the
    engine's StructuredOutputManager.compile, whose cache the engine thread then reads);
    400 naming the field with llguidance's reason."""
    try:
        await tokenizers.run(_compile, compile_fn, so)
    except ParameterError as exc:
        raise APIError(str(exc), exc.param) from None


def _compile(tokenizer: Any, compile_fn: Any, so: StructuredOutput) -> None:
    compile_fn(so, tokenizer)
