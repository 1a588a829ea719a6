"""Structured outputs through the official `openai` client: response_format json_schema (and
`chat.completions.parse` with a pydantic model), json_object, vLLM's structured_outputs and
guided_* fields on both endpoints, streaming, and 400s naming the field of a bad constraint."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from e2e_server import ServerProcess
from openai import OpenAI
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["city", "population", "sights"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe Paris as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population: int = Field(ge=0, le=10**8)


@pytest.fixture(scope="module")
def server(server_factory) -> ServerProcess:
    server = server_factory()
    server.wait_healthy()
    return server


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


GRAMMAR = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'


def requests(client: OpenAI, model: str) -> dict[str, Callable[[], Any]]:
    """Every generating request of the module, sent at once (so they share steps)."""
    chat, completions = client.chat.completions, client.completions
    return {
        "json_schema": lambda: chat.create(
            model=model, messages=CHAT, max_tokens=80, temperature=0.0,
            response_format=json_schema_format(SCHEMA),
        ),
        "parse": lambda: chat.parse(
            model=model, messages=[{"role": "user", "content": "Tell me about Rome."}],
            response_format=City, max_tokens=48, temperature=0.0,
        ),
        "json_object": lambda: chat.create(
            model=model, messages=CHAT, max_tokens=60, temperature=0.0,
            response_format={"type": "json_object"},
        ),
        "regex": lambda: completions.create(
            model=model, prompt="My phone number is ", max_tokens=20, temperature=0.8, seed=1,
            extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
        ),
        "choice": lambda: completions.create(
            model=model, prompt="The sky is ", max_tokens=10, temperature=0.8, seed=2, n=2,
            extra_body={"structured_outputs": {"choice": ["blue", "green", "red"]}},
        ),
        "grammar": lambda: chat.create(
            model=model, messages=[{"role": "user", "content": "What is 6 x 7?"}],
            max_tokens=20, temperature=0.0, extra_body={"structured_outputs": {"grammar": GRAMMAR}},
        ),
        "guided_choice": lambda: chat.create(
            model=model, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5,
            temperature=0.0, extra_body={"guided_choice": ["Yes", "No"]},
        ),
        "stream": lambda: list(chat.create(
            model=model, messages=CHAT, max_tokens=80, temperature=0.8, seed=3, stream=True,
            response_format=json_schema_format(SCHEMA),
        )),
    }  # fmt: skip


@pytest.fixture(scope="module")
def results(client, model) -> dict[str, Future]:
    with ThreadPoolExecutor(8) as pool:
        return {name: pool.submit(call) for name, call in requests(client, model).items()}


def test_response_format_json_schema_validates(results):
    choice = results["json_schema"].result().choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_parse_with_a_pydantic_model_returns_the_object(results):
    completion = results["parse"].result()
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert City.model_validate_json(completion.choices[0].message.content) == parsed


def test_json_object(results):
    response = results["json_object"].result()
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_structured_outputs_and_guided_fields(results):
    assert re.fullmatch(r"\d{3}-\d{4}", results["regex"].result().choices[0].text)
    choices = results["choice"].result().choices
    assert len(choices) == 2 and all(c.text in ("blue", "green", "red") for c in choices)
    content = results["grammar"].result().choices[0].message.content
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", content)
    choice = results["guided_choice"].result().choices[0]
    assert choice.message.content in ("Yes", "No") and choice.finish_reason == "stop"


def test_streamed_json_reassembles(results):
    parts, reasons = [], []
    for chunk in results["stream"].result():
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop" and len(parts) > 3
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param", "reason"),
    [
        ({"response_format": json_schema_format({"type": "objekt"})},
         "response_format.json_schema.schema", "Invalid type: objekt"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex",
         "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: foo"}}, "guided_grammar", "unknown name"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice",
         "only one"),
    ],
)  # fmt: skip
def test_invalid_constraints_are_400s_naming_the_field(client, model, extra, param, reason):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, **extra)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == param
    assert reason in error["message"], error["message"]
