"""Tool calling in /v1/chat/completions: the request's `tools` and `tool_choice` checked
(400s naming the field), the conversation made ready for the chat template, and the grammar
that forces calls for `tool_choice: "required"` or a named function.

Templates.  A chat template that reads `tools` (Qwen 2.5, Hermes, Llama 3.1, ...) gets the
tools and the messages as Hugging Face templates expect them (assistant `tool_calls` with
`arguments` as an object, `tool` messages with `tool_call_id`).  A template that does not
(SmolLM2's ChatML, the embedded model) would silently drop the tools, so kvserve renders them
itself, in the Hermes/Qwen style the `hermes` parser reads:

- a system block lists the functions as JSON inside <tools></tools> and asks for
  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (appended to the first system
  message, or a system message of its own);
- an assistant message's `tool_calls` become its text: <tool_call> blocks after its content;
- `tool` messages become a user message of <tool_response> blocks (consecutive ones joined),
  which every template accepts.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.request import StructuredOutput
from kvserve.server.errors import APIError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools: `tools` for the template (None: none), `choice`
    "none" | "auto" | "required" | "named" and the named function, and whether to parse."""

    tools: list[dict[str, Any]] | None
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def parse(self) -> bool:
        return self.tools is not None and self.choice != "none"


def check_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolRequest:
    """The request's tool fields, checked; 400 naming tools[i].<field> or tool_choice."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    checked = [_check_tool(i, tool) for i, tool in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(
                f"tools[{i}].function.name: {name!r} is already the name of another tool",
                f"tools[{i}].function.name",
            )
    choice, named = _check_choice(tool_choice, names)
    return ToolRequest(checked or None, choice, named, parallel)


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(f'{where} must be an object {{"type": "function", ...}}', where)
    if tool.get("type") != "function":
        got = str(tool.get("type"))[:40]
        raise APIError(f"{where}.type must be 'function', got {got!r}", f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(f"{where}.function must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise APIError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
            f"got {str(name)[:70]!r}",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{where}.function.parameters")
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise APIError(f"{where} must be a JSON schema object", where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError(
            f"{where} must describe an object (type 'object'), got {str(kind)[:40]!r}", where
        )
    try:
        import jsonschema  # noqa: PLC0415 - optional: a deeper check where it is installed
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise APIError(f"{where} is not a valid JSON schema: {exc.message[:200]}", where) from None


def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice in ("none", "auto"):
        return tool_choice, None
    if tool_choice == "required":
        if not names:
            raise APIError("tool_choice 'required' needs tools", "tool_choice")
        return "required", None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                'tool_choice must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise APIError(
                f"tool_choice names function {name[:70]!r}, which is not in tools "
                f"({', '.join(names[:10]) or 'none given'})",
                "tool_choice",
            )
        return "named", name
    raise APIError(
        f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
        f'"function": {{"name": ...}}}}, got {str(tool_choice)[:40]!r}',
        "tool_choice",
    )


# ---------------------------------------------------------------------- the grammar
def tool_call_grammar(request: ToolRequest) -> str:
    """A Lark grammar (llguidance's dialect) of the hermes format: one <tool_call> block (the
    named function, or parallel_tool_calls false) or several, each calling one of the tools
    with arguments that follow its `parameters` schema."""
    assert request.tools is not None
    tools = [t["function"] for t in request.tools]
    if request.named is not None:
        tools = [f for f in tools if f["name"] == request.named]
    many = request.choice == "required" and request.parallel
    lines = [
        'start: tool_call ("\\n" tool_call)*' if many else "start: tool_call",
        'tool_call: "<tool_call>\\n" call "\\n</tool_call>"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, function in enumerate(tools):
        head = json.dumps('{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_grammar_schema(function))}")
    return "\n".join(lines) + "\n"


def _grammar_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters; no free whitespace (a small model may write it forever),
    the separators of json.dumps, and no arguments beyond the declared ones unless the schema
    says `additionalProperties` itself (JSON schema's default allows any: a small model then
    invents keys until max_tokens)."""
    schema = copy.deepcopy(function.get("parameters") or EMPTY_PARAMETERS)
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    guidance = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        **guidance,
    }
    return schema


def structured_output(request: ToolRequest) -> StructuredOutput | None:
    """The constraint of `required` and of a named function; None for auto and none."""
    if request.choice not in ("required", "named"):
        return None
    return StructuredOutput(grammar=tool_call_grammar(request), source="tool_choice")


# ---------------------------------------------------------------------- the template
@functools.lru_cache(maxsize=8)
def template_reads_tools(template: str) -> bool:
    """Whether a chat template uses the `tools` variable (then it renders them itself)."""
    import jinja2  # noqa: PLC0415
    from jinja2 import meta  # noqa: PLC0415

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return "tools" in template


def for_template(
    template: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the chat template: as they are when it reads `tools`,
    else with the tools and the tool messages rendered in the Hermes style (module doc)."""
    if template is not None and template_reads_tools(template):
        return messages, tools
    has_tool_messages = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if not tools and not has_tool_messages:
        return messages, None
    result: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if result and result[-1].get("_tool_responses"):
                result[-1]["content"] += "\n" + response
            else:
                result.append({"role": "user", "content": response, "_tool_responses": True})
        elif message.get("tool_calls"):
            blocks = [message["content"]] if message["content"] else []
            blocks += [_call_block(call["function"]) for call in message["tool_calls"]]
            item = {k: v for k, v in message.items() if k != "tool_calls"}
            result.append({**item, "content": "\n".join(blocks)})
        else:
            result.append(message)
    for message in result:
        message.pop("_tool_responses", None)
    if tools:
        block = tools_system_prompt(tools)
        if result and result[0]["role"] in ("system", "developer"):
            first = result[0]
            content = f"{first['content']}\n\n{block}" if first["content"] else block
            result[0] = {**first, "content": content}
        else:
            result.insert(0, {"role": "system", "content": block})
    return result, None


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Qwen 2.5's tool instructions (what Hermes-style models were trained on)."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_block(function: dict[str, Any]) -> str:
    arguments = function.get("arguments")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    head = json.dumps(function["name"])
    return f'<tool_call>\n{{"name": {head}, "arguments": {text}}}\n</tool_call>'
