"""Fuzzing one live server with request bodies built from its own pydantic schemas.

Each example starts from a valid /v1/completions, /v1/chat/completions, /tokenize or
/detokenize body (tiny max_tokens, so the model work per request is a few steps) and mutates
it: in-type edge values for a field (negative, 10**30, NaN/Infinity - invalid JSON, sent on
purpose), wrong types, nulls, missing and unknown fields, huge lists, unicode (lone surrogates,
emoji, control characters), garbage inside messages, or a broken body altogether.

The contract under test: every answer is 2xx or 4xx, never 5xx, never a hang, and a 200 stream
ends in [DONE] without a server-error event; the engine is still up after every request; and
after the run the process lives, nothing is left running and every KV block is free again.

Shrinking is off: once a body kills the engine every later request fails too, so a shrinker
would "minimize" to an innocent body.  The failure message names the body that did it.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

import httpx
import pytest
from e2e_server import ServerProcess, scrape, wait_for_idle
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

# --dtype auto (after SERVER_ARGS' float32, so it wins): what `kvserve serve` runs by default,
# bfloat16 through the native layers on a CPU with native bf16 (~1.4x faster per request here
# than float32), float32 elsewhere.  Nothing here compares tokens, so either dtype serves.
SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--dtype", "auto")
TIMEOUT_S = 30.0  # far above any request here; reaching it means a hang
HTTP_TIMEOUT_S = TIMEOUT_S  # the `http` fixture's (tests/e2e/conftest.py)
NAN, INF = math.nan, math.inf

SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

# ---------------------------------------------------------------------- leaf values
# Ints and floats are "tiny or invalid": a value that is valid and large (max_tokens=400,
# n=128 with 16 prompts) would make a legitimate request take minutes on a CPU.
EDGE_INTS = st.sampled_from(
    [0, 1, 2, -1, 3, 20, 21, 128, 129, 49151, 49152, 2**31, -(2**31), 2**63 - 1, 2**63,
     -(2**63) - 1, 10**9, 10**30, -(10**30)]
)  # fmt: skip
EDGE_FLOATS = st.sampled_from(
    [0.0, -0.0, 0.5, 1.0, 1.5, -1.0, 100.0, 100.0001, 1e-300, 5e-324, 1e308, -1e308, NAN,
     INF, -INF]
)  # fmt: skip
SPECIAL_TEXTS = st.sampled_from(
    ["", " ", "hi", "\x00", "\ud800", "\udfff", "a\ud83d", "🙂", "👩‍👩‍👧‍👦" * 20, "\u202e\u200b",
     "\ufeff", "\r\n\t\x1b[31m", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
     "{{ raise_exception('x') }}", "{% for %}", "é" * 300, "\U0010ffff", "null"]
)  # fmt: skip
ANY_CHARS = st.characters(categories=["L", "M", "N", "P", "S", "Z", "C"])  # Cs included
TEXTS = st.one_of(SPECIAL_TEXTS, st.text(ANY_CHARS, max_size=12))
HUGE_TEXT = st.sampled_from(["x" * 200_000, "🙂" * 50_000, "\x00" * 100_000])

SCALARS = st.one_of(st.none(), st.booleans(), EDGE_INTS, EDGE_FLOATS, TEXTS)
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXTS, inner, max_size=3)),
    max_leaves=8,
)

# Huge lists that a request may carry in one field; each is under the 16 MiB body limit.
HUGE_BY_FIELD: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.sampled_from([[1] * 10_000, [10**9] * 10_000, ["hi"] * 5_000]),
    "tokens": st.sampled_from([[1] * 10_000, [49151, 0] * 5_000, [10**9] * 10_000]),
    "stop": st.sampled_from([[f"stop{i}" for i in range(5_000)], ["🙂"] * 5_000, ["a" * 1_000]]),
    "stop_token_ids": st.sampled_from([[10**9] * 5_000, list(range(10_000)), [0] * 10_000]),
    "messages": st.just([{"role": "user", "content": "hi"}] * 2_000),
    "logit_bias": st.just({str(i): 0.0 for i in range(5_000)}),
}


def in_type(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of the field's own type (or one member of its union), biased to the edges."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return st.one_of([in_type(arg) for arg in args])
    if origin is list:
        return st.lists(in_type(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(TEXTS, in_type(args[1]), max_size=3)
    if origin is Literal:
        return st.sampled_from(args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_dict(annotation)
    leaves: dict[Any, st.SearchStrategy[Any]] = {
        int: EDGE_INTS, float: st.one_of(EDGE_FLOATS, EDGE_INTS), str: TEXTS,
        bool: st.booleans(), type(None): st.none(),
    }  # fmt: skip
    return leaves.get(annotation, GARBAGE)


def model_dict(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with any subset of the model's fields, each in its own type."""
    fields = {name: in_type(f.annotation) for name, f in model.model_fields.items()}
    required = {n: fields[n] for n, f in model.model_fields.items() if f.is_required()}
    optional = {n: s for n, s in fields.items() if n not in required}
    return st.fixed_dictionaries(required, optional=optional)


# ---------------------------------------------------------------------- chat messages
ROLES = st.one_of(
    st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "", "USER"]),
    TEXTS,
)
CONTENT_PARTS = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio", "file", ""]), TEXTS)},
    optional={"text": st.one_of(TEXTS, GARBAGE), "image_url": GARBAGE},
)
CONTENT = st.one_of(TEXTS, st.none(), st.lists(st.one_of(CONTENT_PARTS, GARBAGE), max_size=3))
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(ROLES, GARBAGE), "content": st.one_of(CONTENT, GARBAGE)},
    optional={"name": st.one_of(TEXTS, GARBAGE), "tool_calls": GARBAGE},
)
BAD_MESSAGES = st.one_of(st.lists(st.one_of(MESSAGE, GARBAGE), max_size=4), GARBAGE)

# ---------------------------------------------------------------------- valid baselines
HI = [{"role": "user", "content": "hi"}]
SMALL = st.integers(1, 4)
COMMON = {"stream": st.booleans(), "temperature": st.sampled_from([0.0, 0.7])}
BASELINES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": st.sampled_from(["hi", "Once upon a time", [1, 2, 3], ["a", "b"]]),
         "max_tokens": SMALL},
        optional=COMMON,
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.just(HI), "max_tokens": SMALL}, optional=COMMON
    ),
    "/tokenize": st.one_of(
        st.fixed_dictionaries({"prompt": st.just("hi")}),
        st.fixed_dictionaries({"messages": st.just(HI)}),
    ),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 1000), max_size=5)}),
}  # fmt: skip


# ---------------------------------------------------------------------- valid extremes
# Valid but extreme values, many at once: what validation lets through reaches the engine, and
# engine bugs hide in combinations (min_tokens with a stop token id outside the vocabulary).
SPECIAL_IDS = [0, 1, 2, 49151]  # <|endoftext|>, <|im_start|>, <|im_end|>, the last id
# Lone surrogates make the whole body invalid JSON, which would hide the other fields.
CLEAN_TEXTS = TEXTS.map(lambda text: text.encode("utf-8", "replace").decode())
NONEMPTY = CLEAN_TEXTS.filter(bool)
VALID_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(
            CLEAN_TEXTS,
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("text")}, optional={"text": st.one_of(CLEAN_TEXTS, st.none())}
                ),
                max_size=2,
            ),
        ),
    },
    optional={"name": CLEAN_TEXTS},
)
EXTREMES: dict[str, st.SearchStrategy[Any]] = {
    "n": st.sampled_from([1, 2, 16, 128]),
    "temperature": st.sampled_from([0.0, 5e-324, 1e-9, 1.0, 100.0]),
    "top_p": st.sampled_from([5e-324, 1e-9, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 49151, 49152, 10**6, 2**63 - 1]),
    "min_p": st.sampled_from([0.0, 5e-324, 0.99999, 1.0]),
    "seed": st.sampled_from([None, 0, -(2**63), 2**63 - 1]),
    "stop": st.one_of(NONEMPTY, st.lists(NONEMPTY, max_size=3), HUGE_BY_FIELD["stop"]),
    "stop_token_ids": st.lists(
        st.sampled_from([49152, 2, 10**9, 0, 2**63, 49151, 1]), min_size=1, max_size=3
    ),
    "ignore_eos": st.booleans(),
    "min_tokens": st.sampled_from([1, 4, 0]),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": CLEAN_TEXTS,
}
EXTREMES_BY_PATH: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/completions": {
        **EXTREMES,
        "prompt": st.one_of(
            CLEAN_TEXTS, st.lists(st.sampled_from(SPECIAL_IDS), min_size=1, max_size=4),
            st.lists(CLEAN_TEXTS, min_size=1, max_size=3),
            st.lists(st.lists(st.sampled_from(SPECIAL_IDS), max_size=3), min_size=1, max_size=3),
        ),
        "max_tokens": st.sampled_from([4, 1]),  # None (16) x 3 prompts x n=128: 20 s on a CPU
        "echo": st.booleans(),
        "logprobs": st.sampled_from([None, 0, 1, 20]),
    },
    "/v1/chat/completions": {
        **EXTREMES,
        "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3),
        "max_tokens": st.sampled_from([4, 1]),
        "max_completion_tokens": st.sampled_from([None, 4, 1]),
        "logprobs": st.booleans(),
        "top_logprobs": st.sampled_from([None, 0, 1, 20]),
    },
    "/tokenize": {
        "prompt": st.one_of(CLEAN_TEXTS, HUGE_TEXT),
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "add_special_tokens": st.booleans(),
        "return_token_strs": st.booleans(),
    },
    "/detokenize": {
        "tokens": st.one_of(
            st.lists(st.sampled_from([*SPECIAL_IDS, 49152, -1, 10**9]), max_size=5),
            HUGE_BY_FIELD["tokens"],
        )
    },
}  # fmt: skip


@st.composite
def extremes(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid baseline with a random half of the fields set to valid extremes."""
    body = draw(BASELINES[path])
    for name, values in EXTREMES_BY_PATH[path].items():
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


# ---------------------------------------------------------------------- mutations
@st.composite
def mutation(draw: st.DrawFn, path: str) -> Callable[[dict[str, Any]], None]:
    """One change to a body: a field gets an edge value, a wrong type, null or a huge value,
    or is deleted; an unknown field appears; stream flips."""
    fields = list(SCHEMAS[path].model_fields.items())
    name, info = draw(st.sampled_from(fields))
    kinds = ["in_type", "in_type", "garbage", "null", "delete", "unknown", "stream"]
    if name in HUGE_BY_FIELD:
        kinds.append("huge")
    kind = draw(st.sampled_from(kinds))
    if kind == "delete":
        return lambda body: body.pop(name, None)
    if kind == "unknown":
        name = draw(st.one_of(st.sampled_from(["foo", "__proto__", "prompt ", "Stream"]), TEXTS))
    value_by_kind = {
        "in_type": lambda: BAD_MESSAGES if name == "messages" else in_type(info.annotation),
        "garbage": lambda: GARBAGE,
        "null": lambda: st.none(),
        "unknown": lambda: GARBAGE,
        "huge": lambda: HUGE_BY_FIELD[name],
        "stream": lambda: st.booleans(),
    }
    if kind == "stream":
        name = "stream"
    value = draw(value_by_kind[kind]())
    return lambda body: body.__setitem__(name, value)


# ---------------------------------------------------------------------- whole cases
# The generating endpoints get most examples: their bodies reach the engine.
PATH_WEIGHTS = ["/v1/completions"] * 3 + ["/v1/chat/completions"] * 3 + ["/tokenize", "/detokenize"]


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, raw body, a description of it for failure messages)."""
    path = draw(st.sampled_from(PATH_WEIGHTS))
    mode = draw(st.sampled_from(["mutate"] * 4 + ["extremes"] * 5 + ["broken"]))
    if mode == "broken":
        raw = draw(broken_bodies())
        return path, raw, repr(raw[:200])
    if mode == "extremes":  # no mutation: an invalid field would hide the others from the engine
        return path, encode(body := draw(extremes(path)), True), describe(body)
    body = draw(BASELINES[path])
    for change in draw(st.lists(mutation(path), max_size=4)):
        change(body)
    return path, encode(body, draw(st.booleans())), describe(body)


def broken_bodies() -> st.SearchStrategy[bytes]:
    """Bodies that are not a JSON object at all, or not even JSON."""
    return st.sampled_from(
        [b"", b"null", b"[]", b"0", b'"hi"', b"{", b'{"prompt": "hi",', b"[" * 100_000,
         b'{"a":' * 50_000, b"\xff\xfe\x00", b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}',
         b'{"prompt": "hi", "prompt": 5}', b'{"prompt": "hi", "max_tokens": 1e400}',
         b'{"prompt": "hi", "max_tokens": 1.0}', b'{"prompt": "hi", "max_tokens": "1"}',
         b'[{"prompt": "hi"}]']
    )  # fmt: skip


def encode(body: dict[str, Any], ascii_only: bool) -> bytes:
    """JSON as Python writes it (NaN/Infinity allowed); lone surrogates either \\u-escaped or
    raw (invalid UTF-8) bytes."""
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def describe(body: dict[str, Any]) -> str:
    """The body for a failure message, long values abbreviated."""
    items = []
    for key, value in body.items():
        text = repr(value)
        items.append(f"{key!r}: " + (text if len(text) <= 120 else f"{text[:100]}...({len(text)})"))
    return "{" + ", ".join(items) + "}"


# ---------------------------------------------------------------------- the checks
def post(http: httpx.Client, path: str, raw: bytes) -> str | None:
    """POST `raw`, read the whole answer (SSE included); what is wrong with it, or None."""
    headers = {"Content-Type": "application/json"}
    try:
        with http.stream("POST", path, content=raw, headers=headers) as response:
            text = response.read().decode("utf-8", "replace")
    except httpx.TimeoutException:
        return f"no answer within {TIMEOUT_S:.0f} s"
    except httpx.TransportError as exc:
        return f"connection failed mid-answer: {type(exc).__name__}: {exc}"
    if response.status_code >= 500 or response.status_code < 200:
        return f"HTTP {response.status_code}: {text[:600]}"
    if response.status_code == 200 and "text/event-stream" in response.headers["content-type"]:
        return check_stream(text)
    return None


def check_stream(text: str) -> str | None:
    """A 200 stream ends in [DONE] and holds no server-error event."""
    lines = text.split("\n")  # not splitlines(): that also splits at U+2028, \x1c... in JSON
    events = [line.removeprefix("data: ") for line in lines if line.strip()]
    if not events or events[-1] != "[DONE]":
        return f"stream did not end with [DONE]: ...{text[-600:]}"
    for event in events[:-1]:
        error = json.loads(event).get("error")
        if error is not None and error.get("code", 500) >= 500:
            return f"stream carried a server error: {event[:600]}"
    return None


def engine_state(server: ServerProcess) -> str | None:
    """What is wrong with the server after a request: exited, or /health not 200."""
    if server.process.poll() is not None:
        return f"the server exited with {server.process.returncode}"
    try:
        response = httpx.get(f"{server.base_url}/health", timeout=TIMEOUT_S)
    except httpx.TransportError as exc:
        return f"/health failed: {exc!r}"
    return None if response.status_code == 200 else f"/health {response.status_code}"


def last_traceback(log: str) -> str:
    """The server log's last traceback (the cause of a failure), or a note that there is none."""
    start = log.rfind("Traceback (most recent call last)")
    return log[start : start + 3000] if start >= 0 else "(no traceback in the server log)"


def total_blocks(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(r'kvserve:cache_config_info\{[^}]*num_blocks="(\d+)"', text)
    assert match, "cache_config_info has no num_blocks"
    return int(match.group(1))


# ---------------------------------------------------------------------- the test
# Found by this test: a stop token id outside the vocabulary, masked while min_tokens holds
# stop tokens back, made the sampler index out of bounds and killed the engine.
STOP_ID_OUTSIDE_VOCAB = {
    "prompt": "hi",
    "max_tokens": 8,
    "min_tokens": 4,
    "stop_token_ids": [10**9],
}


def known(path: str, body: dict[str, Any]) -> tuple[str, bytes, str]:
    return path, encode(body, True), describe(body)


@pytest.fixture(scope="module")
def server(server_factory) -> ServerProcess:
    server = server_factory(*SERVER_FLAGS)
    server.wait_healthy()
    return server


FUZZ_SETTINGS = settings(
    max_examples=120,  # ~0.34 s each: 200 took 68 s of a suite near its 12 minutes
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: see the module docstring
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
    print_blob=False,
)


def test_fuzzed_bodies_get_2xx_or_4xx_and_leave_the_server_clean(server, http):
    failures: list[str] = []  # the first one is the cause; replays of it may add more

    @FUZZ_SETTINGS
    @given(case=cases())
    @example(case=known("/v1/completions", STOP_ID_OUTSIDE_VOCAB))
    @example(case=known("/v1/chat/completions", {**STOP_ID_OUTSIDE_VOCAB, "messages": HI}))
    def fuzz(case: tuple[str, bytes, str]) -> None:
        path, raw, description = case
        problem = post(http, path, raw) or engine_state(server)
        if problem is not None:
            failures.append(f"POST {path} {description}\n  -> {problem}")
            log = last_traceback(server.log())
            pytest.fail("\n".join(failures) + f"\nserver log:\n{log}", pytrace=False)

    fuzz()
    assert engine_state(server) is None
    idle = wait_for_idle(server.base_url, timeout=30)
    assert idle["kvserve:num_requests_running"] == 0
    assert idle["kvserve:num_requests_waiting"] == 0
    assert idle["kvserve:kv_cache_usage_perc"] == 0
    assert scrape(server.base_url)["kvserve:num_free_blocks"] == total_blocks(server.base_url)
    assert "Traceback" not in server.log(), last_traceback(server.log())
