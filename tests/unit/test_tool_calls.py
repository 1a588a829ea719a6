"""Tool calls without a model: the hermes parser (whole outputs and streams cut anywhere), the
checks of tools/tool_choice (400s naming the field), the chat template's input, the grammar of
tool_choice "required"/named compiled and run by llguidance, and the response built from a
known output."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jsonschema
import llguidance.hf
import pytest

from kvserve.request import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, DeltaMessage, DeltaToolCall
from kvserve.server.serving_chat import ChatHandler, messages_to_dicts
from kvserve.server.tokenization import _chat
from kvserve.server.tool_parsers import PARSERS, CallDelta, get_parser
from kvserve.server.tools import (
    check_tools,
    for_template,
    structured_output,
    template_reads_tools,
    tool_call_grammar,
)
from kvserve.step import CompletionOutput, RequestOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
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
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "celsius", "x": {"deep": [1, {"y": "}"}]}}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.'
)
MALFORMED = 'Hi <tool_call>\n{"name": "get_weather" "arguments": {"city": "x"}}\n</tool_call> there'
BAD_ARGUMENTS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
NOT_A_CALL = '<tool_call>\n{"function": "get_weather"}\n</tool_call>'
PLAIN = "1 < 2 and <tool is not a call; a } brace."
UNCLOSED = 'ok\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}'
TRUNCATED = 'ok\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
REORDERED = '<tool_call>{"arguments": {"a": 1}, "name": "get_time"}</tool_call>'
ESCAPED = (
    '<tool_call>\n{"name": "get_time", "arguments": {"q": "a \\"</b>\\" \\u00e9"}}\n</tool_call>'
)


def parse(text):
    return get_parser("hermes").parse(text)


# ---------------------------------------------------------------------- the parser
def test_one_call_is_parsed_with_the_models_own_arguments_text():
    out = parse(CALL)
    assert out.content is None
    [call] = out.calls
    assert call.name == "get_weather"
    assert call.arguments == '{"city": "Paris", "unit": "celsius"}'
    assert call.id.startswith("call_") and len(call.id) > 10


def test_several_calls_and_the_text_around_them():
    out = parse(TWO_CALLS)
    assert [c.name for c in out.calls] == ["get_weather", "get_time"]
    assert json.loads(out.calls[0].arguments)["x"] == {"deep": [1, {"y": "}"}]}
    assert out.calls[1].arguments == "{}"
    assert out.content == "Let me look.Done."
    assert len({c.id for c in out.calls}) == 2


@pytest.mark.parametrize("text", [MALFORMED, BAD_ARGUMENTS, NOT_A_CALL, PLAIN, TRUNCATED, ""])
def test_malformed_blocks_and_plain_text_stay_content(text):
    out = parse(text)
    assert out.calls == [] and out.content == text


def test_a_malformed_block_beside_a_good_one_stays_in_the_content():
    out = parse(MALFORMED + "\n" + CALL)
    assert [c.name for c in out.calls] == ["get_weather"]
    assert out.content == MALFORMED


def test_an_unclosed_last_block_is_a_call_when_its_json_parses():
    out = parse(UNCLOSED)
    assert out.content == "ok" and out.calls[0].name == "get_time"
    assert json.loads(out.calls[0].arguments) == {"tz": "UTC"}


def test_other_key_orders_are_serialized():
    [call] = parse(REORDERED).calls
    assert call.name == "get_time" and call.arguments == '{"a": 1}'


def stream_pieces(text, rng):
    parser = get_parser("hermes").stream()
    items, i = [], 0
    while i < len(text):
        size = rng.randint(1, 7)
        items += parser.feed(text[i : i + size])
        i += size
    return items + parser.finish()


def reassemble(items):
    content = "".join(x for x in items if isinstance(x, str))
    calls: dict[int, dict] = {}
    for item in items:
        if isinstance(item, CallDelta):
            if item.name is not None:
                assert item.index not in calls, "a call's name comes once, first"
                assert item.id.startswith("call_") and item.arguments == ""
                calls[item.index] = {"name": item.name, "arguments": ""}
            else:
                calls[item.index]["arguments"] += item.arguments
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize(
    "text", [CALL, TWO_CALLS, MALFORMED, NOT_A_CALL, PLAIN, UNCLOSED, REORDERED, ESCAPED,
             MALFORMED + "\n" + CALL, "  \n" + CALL + "\n\n", "text only\n\n"],
)  # fmt: skip
def test_a_stream_cut_anywhere_gives_what_the_whole_text_gives(text):
    whole = parse(text)
    expected = (whole.content or "", [(c.name, c.arguments) for c in whole.calls])
    rng = random.Random(text)
    for _ in range(60):
        assert reassemble(stream_pieces(text, rng)) == expected
    # one character at a time, and all at once
    parser = get_parser("hermes").stream()
    items = [x for ch in text for x in parser.feed(ch)] + parser.finish()
    assert reassemble(items) == expected
    parser = get_parser("hermes").stream()
    assert reassemble(parser.feed(text) + parser.finish()) == expected


def test_a_stream_sends_the_name_early_then_arguments_in_pieces_and_no_markup():
    parser = get_parser("hermes").stream()
    items = []
    for ch in "Sure. " + CALL:
        items += parser.feed(ch)
    items += parser.finish()
    assert "".join(x for x in items if isinstance(x, str)) == "Sure."
    calls = [x for x in items if isinstance(x, CallDelta)]
    assert calls[0].name == "get_weather"
    assert len(calls) > 10  # arguments came as they were written
    # the name went out before the arguments were complete
    parser = get_parser("hermes").stream()
    head = parser.feed(CALL[: CALL.index("Paris")])
    assert [x.name for x in head if isinstance(x, CallDelta)] == ["get_weather", None]
    assert head[-1].arguments == '{"city": "'
    assert not any("<" in x for x in items if isinstance(x, str))
    assert parser.num_calls == 0


def test_a_stream_keeps_a_call_whose_name_went_out_before_its_arguments_broke():
    """The documented difference: the whole text makes it content; a stream had sent the
    name (and the arguments as far as they parsed) and cannot take them back."""
    parser = get_parser("hermes").stream()
    items = [x for ch in BAD_ARGUMENTS for x in parser.feed(ch)] + parser.finish()
    content, calls = reassemble(items)
    assert content == "" and calls == [("get_weather", '{"city":')]
    assert parse(BAD_ARGUMENTS).calls == []


def test_plain_text_streams_as_it_comes():
    parser = get_parser("hermes").stream()
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" world <") == [" world"]  # "<" may start <tool_call>
    assert parser.feed("3") == [" <3"]
    assert parser.finish() == []


def test_the_registry_names_the_flag_choices():
    assert "hermes" in PARSERS
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope")


# ---------------------------------------------------------------------- the checks
def bad(tools, choice=None, parallel=None):
    with pytest.raises(APIError) as info:
        check_tools(tools, choice, parallel)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        (["x"], "tools[0]"),
        ([WEATHER, {"type": "retrieval"}], "tools[1].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f" * 65}}], "tools[0].function.name"),
        ([TIME, TIME], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}],
         "tools[0].function.description"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"type": "nonsense"}}}}}], "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(tools, param):
    error = bad(tools)
    assert error.param == param and param in error.message


@pytest.mark.parametrize(
    ("choice", "tools"),
    [("sometimes", TOOLS), ("required", None), ({"type": "function"}, TOOLS),
     ({"type": "function", "function": {"name": "missing"}}, TOOLS), (3, TOOLS)],
)  # fmt: skip
def test_bad_tool_choice_is_a_400_naming_it(choice, tools):
    assert bad(tools, choice).param == "tool_choice"


def test_tool_choice_defaults_and_modes():
    assert check_tools(None, None, None).choice == "none"
    auto = check_tools(TOOLS, None, None)
    assert auto.choice == "auto" and auto.parse and auto.parallel
    assert not check_tools(TOOLS, "none", None).parse
    assert check_tools(TOOLS, "none", None).tools is not None  # still templated, as vLLM
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.named, named.parallel) == ("named", "get_time", False)
    assert structured_output(auto) is None
    forced = structured_output(check_tools(TOOLS, "required", None))
    assert forced.source == "tool_choice" and "get_weather" in forced.grammar
    SamplingParams(structured=forced)  # the contract's type


def test_the_request_model_takes_tool_messages():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
            ],
            "tools": TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        }
    )  # fmt: skip
    dicts = messages_to_dicts(body.messages)
    assert dicts[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "id": "call_1",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    }  # fmt: skip
    assert dicts[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    bad_role = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x", "tool_calls": body.messages[1].tool_calls}]}
    )
    with pytest.raises(APIError) as info:
        messages_to_dicts(bad_role.messages)
    assert info.value.param == "messages[0].tool_calls"


# ---------------------------------------------------------------------- the template
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Oslo", "unit": "celsius"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "content": "12 C", "tool_call_id": "a"},
    {"role": "tool", "content": "10:00", "tool_call_id": "b"},
]  # fmt: skip


def test_a_template_that_ignores_tools_gets_them_in_the_hermes_style(embedded_tokenizer):
    assert not template_reads_tools(embedded_tokenizer.chat_template)
    messages, tools = for_template(embedded_tokenizer.chat_template, CONVERSATION, TOOLS)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(WEATHER) in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert messages[3]["content"] == (
        "<tool_response>\n12 C\n</tool_response>\n<tool_response>\n10:00\n</tool_response>"
    )
    # the first system message keeps its text, the tools after it
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    messages, _ = for_template(embedded_tokenizer.chat_template, with_system, TOOLS)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    # and the real template renders all of it
    text = embedded_tokenizer.decode(_chat(embedded_tokenizer, CONVERSATION, TOOLS))
    assert "<tools>" in text and "<tool_response>\n12 C" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools nor tool messages, nothing changes
    plain = [{"role": "user", "content": "hi"}]
    assert for_template(embedded_tokenizer.chat_template, plain, None) == (plain, None)


def test_a_template_that_reads_tools_gets_them_as_they_are(embedded_tokenizer):
    template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
    )
    assert template_reads_tools(template)
    assert for_template(template, CONVERSATION, TOOLS) == (CONVERSATION, TOOLS)
    tokenizer = embedded_tokenizer  # its template swapped for this test, then restored
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = template
        text = tokenizer.decode(_chat(tokenizer, CONVERSATION, TOOLS))
    finally:
        tokenizer.chat_template = saved
    assert "TOOL get_weather\nTOOL get_time" in text
    assert 'CALL get_weather{"city": "Oslo", "unit": "celsius"}' in text


# ---------------------------------------------------------------------- the grammar
@pytest.fixture(scope="module")
def ll_tokenizer(embedded_tokenizer):
    return llguidance.hf.from_tokenizer(embedded_tokenizer)


def matches(grammar, text, ll_tokenizer, tokenizer):
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar))
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


def test_the_tool_grammars_compile_and_accept_only_calls(ll_tokenizer, embedded_tokenizer):
    from llguidance import LLMatcher

    required = tool_call_grammar(check_tools(TOOLS, "required", None))
    single = tool_call_grammar(check_tools(TOOLS, "required", False))
    named = tool_call_grammar(
        check_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    )
    for grammar in (required, single, named):
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar), ll_tokenizer) == ""

    def ok(grammar, text):
        return matches(grammar, text, ll_tokenizer, embedded_tokenizer)

    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert ok(required, CALL) and ok(required, time_call)
    assert ok(required, CALL + "\n" + time_call)
    assert not ok(single, CALL + "\n" + time_call) and ok(single, CALL)
    assert ok(named, CALL) and not ok(named, time_call)
    for wrong in (
        "Sure! " + CALL,  # text first
        CALL.replace('"celsius"', '"kelvin"'),  # not in the enum
        CALL.replace(', "unit": "celsius"', ""),  # a required property missing
        CALL.replace("get_weather", "get_whether"),  # no such function
        '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>',
    ):
        assert not ok(required, wrong), wrong
    # what the grammar lets through, the parser reads, and the arguments fit the schema
    [call] = parse(CALL).calls
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_undeclared_arguments_are_refused_unless_the_schema_allows_them(
    ll_tokenizer, embedded_tokenizer
):
    open_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip
    extra = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    plain = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    grammar = tool_call_grammar(check_tools([open_tool], "required", None))
    assert matches(grammar, plain, ll_tokenizer, embedded_tokenizer)
    assert not matches(grammar, extra, ll_tokenizer, embedded_tokenizer)
    open_tool["function"]["parameters"]["additionalProperties"] = True
    grammar = tool_call_grammar(check_tools([open_tool], "required", None))
    assert matches(grammar, extra, ll_tokenizer, embedded_tokenizer)


def test_a_function_name_needing_no_escape_and_a_schema_with_quotes_compile(ll_tokenizer):
    from llguidance import LLMatcher

    tool = {"type": "function", "function": {"name": "say-it_2", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^\"[a-z]+\\\\n$",
                                              "description": "a \"quoted\"\nline"}}}}}  # fmt: skip
    grammar = tool_call_grammar(check_tools([tool], "required", None))
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar), ll_tokenizer) == ""


# ---------------------------------------------------------------------- responses
def handler():
    ctx = SimpleNamespace(tool_call_parser="hermes", model_name="m", token_text=str)
    return ChatHandler(ctx)  # type: ignore[arg-type]


def final_output(*texts, reason="stop"):
    outputs = [CompletionOutput(i, t, [1, 2, 3], reason) for i, t in enumerate(texts)]
    return RequestOutput("r", None, [5, 6], outputs, True)


def test_auto_response_has_tool_calls_and_finish_reason_tool_calls():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    response = handler()._response("id", body, final_output(TWO_CALLS, "no calls"), tools)
    data = json.loads(response.model_dump_json())
    first, second = data["choices"]
    assert first["finish_reason"] == "tool_calls"
    message = first["message"]
    assert message["content"] == "Let me look.Done."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert all(
        c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"]
    )
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {}
    assert second == {**second, "finish_reason": "stop"}
    assert second["message"] == {"role": "assistant", "content": "no calls"}


def test_response_variants_none_single_named_length():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    final = final_output(CALL + "\n" + CALL)
    none = handler()._response("id", body, final, check_tools(TOOLS, "none", None))
    assert none.choices[0].message.content == CALL + "\n" + CALL
    assert none.choices[0].message.tool_calls is None
    single = handler()._response("id", body, final, check_tools(TOOLS, "auto", False))
    message = single.choices[0].message
    assert len(message.tool_calls) == 1 and message.content is None
    assert json.loads(single.model_dump_json())["choices"][0]["message"]["content"] is None
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    named = handler()._response(
        "id", body, final_output(CALL), check_tools(TOOLS, named_choice, None)
    )
    assert named.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    cut = handler()._response(
        "id", body, final_output(CALL, reason="length"), check_tools(TOOLS, "auto", None)
    )
    assert cut.choices[0].finish_reason == "length"


def test_delta_messages_leave_out_what_is_absent():
    call = DeltaToolCall(
        index=0, id="call_1", type="function", function={"name": "f", "arguments": ""}
    )
    first = DeltaMessage(tool_calls=[call])
    assert json.loads(first.model_dump_json()) == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": ""}}]}  # fmt: skip
    later = DeltaMessage(tool_calls=[DeltaToolCall(index=0, function={"arguments": '{"a'})])
    assert json.loads(later.model_dump_json()) == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]
    }
