"""Constrained decoding on the embedded model (offline LLM): every output of a JSON schema
validates, a regex full-matches, a choice is one of the choices, a Lark grammar's output is in
its language, at temperature 0 and 0.8, n = 2, and through a preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import RequestStatus, StructuredOutput

NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "tags": {
                    "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3,
                },
            },
            "required": ["name", "tags"],
            "additionalProperties": False,
        }
    },
    "required": ["user"],
    "additionalProperties": False,
}  # fmt: skip
BOUNDS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "note": {"type": "string", "maxLength": 10},  # optional
    },
    "required": ["color", "count", "score"],
    "additionalProperties": False,
}
ARRAY = {
    "type": "array",
    "items": {"type": "integer", "minimum": -5, "maximum": 5},
    "minItems": 1,
    "maxItems": 4,
}
SCHEMAS = [NESTED, BOUNDS, ARRAY]
PROMPTS = ["A user profile as JSON: ", "Rate this colour as JSON: ", "Some small numbers: "]
LARK = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{1,8}/\n'
LARK_LANGUAGE = r"(hello|hi) [a-z]{1,8}!"


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=64 * 2**20, max_model_len=1024, dtype="float32")


def _params(so: StructuredOutput, temperature: float, **kwargs) -> SamplingParams:
    kwargs = {"max_tokens": 96, "seed": 7, **kwargs}
    return SamplingParams(temperature=temperature, structured=so, **kwargs)


def test_every_kind_of_constraint_holds_at_temperature_0_and_0_8(llm):
    cases = []  # (prompt, params, check)
    for temperature in (0.0, 0.8):
        for schema, prompt in zip(SCHEMAS, PROMPTS, strict=True):
            so = StructuredOutput(json=json.dumps(schema))
            cases.append((prompt, _params(so, temperature), ("json", schema)))
        so = StructuredOutput(regex=r"\d{3}-\d{4}")
        cases.append(("Call me at ", _params(so, temperature), ("regex", r"\d{3}-\d{4}")))
        choices = ("yes", "no", "maybe")
        so = StructuredOutput(choice=choices)
        cases.append(("Is the sky blue? ", _params(so, temperature), ("choice", choices)))
        so = StructuredOutput(grammar=LARK)
        cases.append(("Greet someone: ", _params(so, temperature), ("regex", LARK_LANGUAGE)))
    so = StructuredOutput(json_object=True)
    cases.append(("Any JSON object: ", _params(so, 0.8, n=2), ("json", {"type": "object"})))
    outputs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    for (prompt, params, (kind, expected)), output in zip(cases, outputs, strict=True):
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            text = completion.text
            assert completion.finish_reason == "stop", (prompt, text)
            if kind == "json":
                jsonschema.validate(json.loads(text), expected)
            elif kind == "regex":
                assert re.fullmatch(expected, text), (prompt, text)
            else:
                assert text in expected


def test_max_tokens_before_the_grammar_completes_is_length(llm):
    so = StructuredOutput(json=json.dumps(NESTED))
    [output] = llm.generate([PROMPTS[0]], _params(so, 0.0, max_tokens=3))
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_a_preempted_constrained_request_resumes_its_grammar(llm):
    """Preempted after 4 tokens (its blocks freed, recomputed from prompt and output), the
    request's matcher still stands where its output left it: the output equals that of its
    twin, run alongside without preemption, and validates."""
    so = StructuredOutput(json=json.dumps(BOUNDS))
    params = _params(so, 0.0)
    engine = llm.engine
    engine.add_request("twin", PROMPTS[1], params)
    engine.add_request("preempted", PROMPTS[1], params)
    request = engine.scheduler.requests["preempted"]
    finals = {}
    while request.num_output_tokens < 4:
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.scheduler._preempt(request)
    assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert request.num_preemptions == 1
    final, twin = finals["preempted"].outputs[0], finals["twin"].outputs[0]
    assert final.finish_reason == "stop" and final.token_ids == twin.token_ids
    jsonschema.validate(json.loads(final.text), BOUNDS)
    engine.cache_manager.check_invariants()
