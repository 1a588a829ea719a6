"""Pinned prefixes through a real server (embedded model, an API key, 12 blocks of 16 tokens
of which 3 may be pinned, LRU eviction so that only the pin keeps the prefix): pin chat
messages, flood the cache with one-off prompts until an unpinned prefix is gone, and the
pinned one is still a hit, also after POST /reset_prefix_cache; the cap answers 400 naming
--max-pinned-prefix-fraction; list, unpin, and a reset with include_pinned drops it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from e2e_server import ServerProcess

BLOCK = 16
KEY = "pin-secret"
SYSTEM = [{"role": "system", "content": "You are a terse lighthouse keeper. " * 3}]
QUESTION = [*SYSTEM, {"role": "user", "content": "Which ship came?"}]


@pytest.fixture(scope="module")
def http(server_factory: Callable[..., ServerProcess]) -> Iterator[httpx.Client]:
    server = server_factory(
        "--kv-cache-memory", "9MiB", "--max-model-len", "64", "--api-key", KEY,
        "--prefix-cache-eviction", "lru", "--max-pinned-prefix-fraction", "0.25",
    )  # fmt: skip
    server.wait_healthy()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client


def cached_tokens(http: httpx.Client, **body: object) -> int:
    """Prompt tokens the server found cached for one request of 1 output token."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = http.post(path, json={**body, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def one_off(i: int) -> list[int]:
    """A 48-token prompt (3 blocks) no other request shares (its first token is its own)."""
    return [100 + i] + [(i * 389 + j * 17) % 900 + 100 for j in range(47)]


def test_a_pinned_prefix_survives_a_flood_and_a_reset_and_the_cap_is_a_400(http: httpx.Client):
    assert (
        httpx.post(f"{http.base_url}/v1/prefix_cache/pin", json={"prompt": "x"}).status_code == 401
    )
    pin = http.post("/v1/prefix_cache/pin", json={"messages": SYSTEM, "id": "keeper"})
    assert pin.status_code == 200, pin.text
    info = pin.json()
    system_ids = http.post("/tokenize", json={"messages": SYSTEM}).json()["tokens"]
    question_ids = http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert info["num_tokens"] == len(system_ids) // BLOCK * BLOCK == 16 * info["num_blocks"]
    common = next(
        i for i, (a, b) in enumerate(zip(system_ids, question_ids, strict=False)) if a != b
    )
    expected = min(info["num_tokens"], common // BLOCK * BLOCK)
    assert expected >= BLOCK

    other = one_off(99)
    assert cached_tokens(http, prompt=other) == 0
    assert cached_tokens(http, prompt=other) == 32  # cached: 2 of its 3 blocks (not the last)
    for i in range(4):  # 12 blocks of one-off prompts through the 12 - pinned free ones
        assert cached_tokens(http, prompt=one_off(i)) == 0
    assert cached_tokens(http, messages=QUESTION) == expected
    assert cached_tokens(http, prompt=other) == 0  # evicted: the flood was large enough

    assert http.post("/reset_prefix_cache").status_code == 200
    assert cached_tokens(http, messages=QUESTION) == expected

    too_long = http.post("/v1/prefix_cache/pin", json={"prompt": one_off(50)})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "--max-pinned-prefix-fraction"
    assert "--max-pinned-prefix-fraction" in error["message"]

    pins = http.get("/v1/prefix_cache/pins").json()
    assert [p["id"] for p in pins["data"]] == ["keeper"]
    assert pins["data"][0]["bytes"] == info["bytes"] > 0
    assert pins["num_pinned_blocks"] == info["num_blocks"]
    assert http.post("/reset_prefix_cache", params={"include_pinned": "true"}).status_code == 200
    assert http.get("/v1/prefix_cache/pins").json()["data"] == []
    assert cached_tokens(http, messages=QUESTION) == 0
    assert http.post("/v1/prefix_cache/unpin", json={"id": "keeper"}).status_code == 404
