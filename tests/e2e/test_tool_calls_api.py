"""Tool calls through the official `openai` client against one server: 400s naming the
field, a conversation holding an assistant `tool_calls` message and a `tool` message, `auto`
(greedy: the embedded model copies a call it is shown) streamed and not, reassembled by the
client's own stream helper to the same call; `tool_choice: "required"` and a named function
give calls whose arguments validate against the schema (constrained decoding)."""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
# Greedy, the embedded model copies the block: a deterministic tool call without a grammar.
COPY_A_CALL = [{"role": "user", "content": "Repeat this text exactly:\n" + CALL_TEXT}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in celsius."}]
ASK_TIME = [{"role": "user", "content": "What time is it in the UTC timezone?"}]


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory("--kv-cache-memory", "128MiB")
    server.wait_healthy()
    return server


def create(client, model, messages, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 64)
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def streamed(client, model, messages, **kwargs):
    """The official client's stream helper: its reassembled final completion, and the raw
    deltas."""
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 64)
    deltas = []
    with client.chat.completions.stream(model=model, messages=messages, **kwargs) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                deltas.append(event.chunk.choices[0].delta)
        return stream.get_final_completion(), deltas


def calls_of(message):
    return [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []]


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_the_field(http, model, body, param):
    response = http.post(
        "/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400
    assert param in error["message"]


def test_tokenize_templates_the_tools(http, model):
    plain = http.post("/tokenize", json={"model": model, "messages": ASK}).json()
    with_tools = http.post("/tokenize", json={"model": model, "messages": ASK, "tools": TOOLS})
    assert with_tools.status_code == 200
    assert with_tools.json()["count"] > plain["count"] + 50  # the tool prompt


# ---------------------------------------------------------------------- conversations
def test_a_conversation_with_a_tool_call_and_its_result(client, model):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_abc", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees, sunny"},
    ]  # fmt: skip
    response = create(client, model, messages, tools=[WEATHER], max_tokens=8)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # and without tools in the request, the history alone is fine too
    response = create(client, model, messages, max_tokens=4)
    assert response.choices[0].message.content


def test_tool_choice_none_never_parses(client, model):
    response = create(client, model, COPY_A_CALL, tools=[TIME], tool_choice="none",
                      max_tokens=8)  # fmt: skip
    message = response.choices[0].message
    assert message.tool_calls is None and message.content.startswith("<tool_call>")


def test_auto_streamed_and_not_give_the_same_call(client, model):
    whole = create(client, model, COPY_A_CALL, tools=[TIME], max_tokens=32)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("function", "get_time", '{"timezone": "UTC"}')]
    assert choice.message.content is None and choice.message.tool_calls[0].id.startswith("call_")

    final, deltas = streamed(client, model, COPY_A_CALL, tools=[TIME], max_tokens=32)
    streamed_choice = final.choices[0]
    assert streamed_choice.finish_reason == "tool_calls"
    assert calls_of(streamed_choice.message) == calls_of(choice.message)
    assert not streamed_choice.message.content  # only the role chunk's ""
    # the name came first and once, then the arguments in several pieces
    fragments = [c for d in deltas for c in d.tool_calls or []]
    assert fragments[0].id and fragments[0].function.name == "get_time"
    assert fragments[0].function.arguments == ""
    assert all(f.id is None and f.function.name is None for f in fragments[1:])
    assert len(fragments) > 3
    assert not any("<tool" in (d.content or "") for d in deltas)


def test_auto_without_a_call_is_a_plain_answer(client, model):
    response = create(client, model, ASK, tools=[WEATHER], max_tokens=4)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    chunks = list(create(client, model, ASK, tools=[WEATHER], max_tokens=4, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


# ---------------------------------------------------------------------- forced calls
def check_calls(message, allowed):
    assert message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_gives_a_call_that_fits_its_schema(client, model):
    # parallel_tool_calls false: one call, so it ends (the grammar of several calls is
    # tests/unit/test_tool_calls.py's)
    single = create(client, model, ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, max_tokens=40)  # fmt: skip
    choice = single.choices[0]
    check_calls(choice.message, {"get_weather", "get_time"})
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
    assert choice.message.content is None


def test_a_named_function_is_called_streamed_and_not(client, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = create(client, model, ASK_TIME, tools=TOOLS, tool_choice=choice, max_tokens=32)
    check_calls(response.choices[0].message, {"get_time"})
    assert len(response.choices[0].message.tool_calls) == 1
    final, _ = streamed(client, model, ASK_TIME, tools=TOOLS, tool_choice=choice, max_tokens=32)
    assert final.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    assert calls_of(final.choices[0].message) == calls_of(response.choices[0].message)
