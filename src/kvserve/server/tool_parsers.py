"""Tool-call parsers (`--tool-call-parser`, vLLM's flag): a model's text -> OpenAI tool calls.

A parser turns a whole output into content and calls (`parse`), and a stream of text deltas
into content fragments and call fragments (`stream()`: a `ToolStreamParser`), such that the
fragments put together give what `parse` gives for the whole text: the same calls (names and
argument strings, character for character) and the same content.

Register another format with `@register("name")` on a `ToolParser` subclass; the flag's
choices are the registry's names.

hermes (the default; Hermes 2 Pro, Qwen 2.5/3 and kvserve's own tool prompt for ChatML
templates that ignore `tools`, server/tools.py):

    text before<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": ...}
    </tool_call>

A block whose JSON does not parse, or is not {"name": <string>, "arguments": <object>}, stays
in the content as the model wrote it.  A last block the output ends inside of (no
</tool_call>: the model stopped after the JSON) is a call when its JSON parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

PARSERS: dict[str, type[ToolParser]] = {}


def register(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def add(cls: type[ToolParser]) -> type[ToolParser]:
        PARSERS[name] = cls
        cls.name = name
        return cls

    return add


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; one of {sorted(PARSERS)}") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    content: str | None  # None when only whitespace is left outside the calls
    calls: list[ParsedCall]


@dataclass
class CallDelta:
    """A fragment of call `index`: the first one has its id and name (and arguments "")."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


# A stream's fragments in order: text (content) or a call fragment.
StreamItem = str | CallDelta


class ToolParser:
    name = ""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def stream(self) -> ToolStreamParser:
        raise NotImplementedError


class ToolStreamParser:
    """One choice's stream: `feed` every text delta, then `finish` once."""

    num_calls: int = 0

    def feed(self, text: str) -> list[StreamItem]:
        raise NotImplementedError

    def finish(self) -> list[StreamItem]:
        raise NotImplementedError


# ---------------------------------------------------------------------- hermes
START, END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
# What a well-formed block starts with, up to its arguments' first character.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\s*\}\s*\Z")  # the object's closing brace, after the arguments


def parse_call(block: str) -> ParsedCall | None:
    """The call in the text between <tool_call> and </tool_call>, or None.

    The arguments are the model's own text when the block is {"name": ..., "arguments": ...}
    in that order with nothing after the arguments (what a stream sends as it comes), else
    the arguments object serialized."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if not isinstance(arguments, dict):
        return None
    head, tail = _HEAD.match(block), _TAIL.search(block)
    if head is not None and tail is not None and head.end() <= tail.start():
        raw = block[head.end() : tail.start()].rstrip()
        try:
            if json.loads(raw) == arguments:
                return ParsedCall(value["name"], raw)
        except ValueError:
            pass
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _join_content(parts: list[str]) -> str | None:
    """Text outside the calls: whitespace next to a call is dropped (the newlines between
    blocks); None when nothing else is left."""
    content = "".join(parts)
    return content if content.strip() else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@register("hermes")
class HermesToolParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        calls: list[ParsedCall] = []
        parts: list[str] = []
        position = 0
        after_call = False
        for match in _BLOCKS.finditer(text):
            block = match.group(1) if match.group(1) is not None else match.group(2)
            call = parse_call(block)
            if call is None:
                continue  # stays in the content, as written
            before = text[position : match.start()]
            parts.append((before.lstrip() if after_call else before).rstrip())
            calls.append(call)
            position, after_call = match.end(), True
        rest = text[position:]
        parts.append(rest.lstrip() if after_call else rest)
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(_join_content(parts), calls)

    def stream(self) -> HermesStreamParser:
        return HermesStreamParser()


@dataclass
class HermesStreamParser(ToolStreamParser):
    """Content is sent as it comes, except what could be the start of <tool_call> and
    whitespace (dropped when a call follows, as `parse` drops it).  A call's name is sent as
    soon as its head ({"name": "...", "arguments": ) is complete, then its arguments as they
    come, holding back what could be the object's closing brace and </tool_call>.  A block
    that turns out malformed before its name was sent goes out as content; one whose name was
    sent stays a call (its arguments as far as they came)."""

    _buffer: str = ""  # outside a call: unsent content; inside: the block so far
    _in_call: bool = False
    _after_call: bool = False  # no content since the last call: leading whitespace dropped
    _name_sent: bool = False
    _args_sent: str = ""
    _space_before: str = ""  # whitespace before the open block: content again if malformed
    num_calls: int = 0

    def feed(self, text: str) -> list[StreamItem]:
        self._buffer += text
        items: list[StreamItem] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(START)
                if start < 0:
                    keep = _partial_suffix(self._buffer, START)
                    body = self._buffer[: len(self._buffer) - keep]
                    sendable = body.rstrip()  # trailing whitespace waits for what follows
                    self._content(items, sendable)
                    self._buffer = self._buffer[len(sendable) :]
                    return items
                before = self._buffer[:start]
                self._content(items, before.rstrip())
                self._space_before = before[len(before.rstrip()) :]
                self._buffer = self._buffer[start + len(START) :]
                self._in_call, self._name_sent, self._args_sent = True, False, ""
                continue
            end = self._buffer.find(END)
            if end < 0:
                self._progress(items)
                return items
            block = self._buffer[:end]
            self._buffer = self._buffer[end + len(END) :]
            self._close(items, block, closed=True)

    def finish(self) -> list[StreamItem]:
        items: list[StreamItem] = []
        if self._in_call:
            block, self._buffer = self._buffer, ""
            self._close(items, block, closed=False)
        else:
            rest, self._buffer = self._buffer, ""
            self._content(items, rest)
        return items

    def _content(self, items: list[StreamItem], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            items.append(text)
            self._after_call = False

    def _progress(self, items: list[StreamItem]) -> None:
        block = self._buffer
        head = _HEAD.match(block)
        if head is None:
            return
        if not self._name_sent:
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return
            items.append(CallDelta(self.num_calls, new_call_id(), name, ""))
            self._name_sent = True
        args = block[head.end() :]
        hold = _partial_suffix(args, END)
        args = args[: len(args) - hold]
        tail = re.search(r"\s*\}?\s*\Z", args)  # a brace that may close the object
        args = args[: tail.start()] if tail else args
        if len(args) > len(self._args_sent) and args.startswith(self._args_sent):
            items.append(CallDelta(self.num_calls, arguments=args[len(self._args_sent) :]))
            self._args_sent = args

    def _close(self, items: list[StreamItem], block: str, closed: bool) -> None:
        self._in_call = False
        call = parse_call(block)
        if not self._name_sent:
            if call is None:  # not a call: the text as the model wrote it
                self._content(items, self._space_before + START + block + (END if closed else ""))
                return
            items.append(CallDelta(self.num_calls, call.id, call.name, ""))
            if call.arguments:
                items.append(CallDelta(self.num_calls, arguments=call.arguments))
        elif call is not None and call.arguments.startswith(self._args_sent):
            rest = call.arguments[len(self._args_sent) :]
            if rest:
                items.append(CallDelta(self.num_calls, arguments=rest))
        self.num_calls += 1
        self._after_call = True
