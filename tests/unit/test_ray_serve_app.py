"""The Ray Serve app's pieces without a Ray cluster: the ingress ASGI app (API key, body limit,
routing text) against a fake replica handle, the bounded prefix tree of the router, Ray's own
router reading a token-id prompt, build_app's server arguments, and a replica (tiny model)
writing its prefix store at shutdown.  tests/e2e/test_ray_serve.py runs the whole app."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import pytest

from kvserve.ray_serve import (
    MAX_ROUTING_CHARS,
    REPLICA_HEADER,
    TOKEN_CHAR_BASE,
    BoundedPrefixRouter,
    BoundedPrefixTree,
    ForwardCall,
    KVServeReplica,
    Reply,
    build_ingress_app,
    routing_prompt,
    server_config_from_args,
)
from kvserve.server.args import ServerConfig

KEY = "sk-test"
LIMIT = 1024


class FakeReplicas:
    """Stands for the replicas' handle: records each call, answers 200."""

    def __init__(self) -> None:
        self.calls: list[ForwardCall] = []

    async def forward(self, call: ForwardCall) -> Reply:
        self.calls.append(call)
        return Reply(200, "application/json", b'{"ok": true}', "replica-0")


def _json(value) -> bytes:
    return json.dumps(value).encode()


def post(app, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.request(kwargs.pop("method", "POST"), path, **kwargs)

    return asyncio.run(go())


def ingress(api_key: str | None = KEY) -> tuple[FakeReplicas, object]:
    replicas = FakeReplicas()
    config = ServerConfig(api_key=api_key, max_request_body_bytes=LIMIT)
    return replicas, build_ingress_app(replicas.forward, config)


# ---------------------------------------------------------------------------- API key
def test_without_or_with_a_wrong_key_the_ingress_answers_401_and_forwards_nothing():
    replicas, app = ingress()
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY}):
        response = post(app, "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        assert "API key" in response.json()["error"]["message"]
    assert replicas.calls == []


def test_with_the_key_the_request_reaches_a_replica_as_sent():
    replicas, app = ingress()
    response = post(app, "/v1/completions", json={"prompt": "hi"},
                    headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "replica-0"
    (call,) = replicas.calls
    assert (call.method, call.path, call.prompt) == ("POST", "/v1/completions", "hi")
    assert call.body == b'{"prompt":"hi"}'


def test_health_and_metrics_stay_open_and_no_key_means_no_check():
    replicas, app = ingress()
    for path in ("/health", "/metrics"):
        assert post(app, path, method="GET").status_code == 200
    _, open_app = ingress(api_key=None)
    assert post(open_app, "/v1/models", method="GET").status_code == 200
    assert [c.path for c in replicas.calls] == ["/health", "/metrics"]


# ---------------------------------------------------------------------------- body limit
async def call_asgi(app, headers: list[tuple[bytes, bytes]], chunks) -> tuple[int, int]:
    """One raw ASGI request whose body comes from the iterator `chunks`; returns the status
    and how many chunks the app had pulled when it answered."""
    pulled = 0
    status = 0

    async def receive() -> dict:
        nonlocal pulled
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("x", 80),
             "client": ("y", 1), "http_version": "1.1",
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), *headers]}  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 60)
    return status, pulled


def test_a_declared_content_length_over_the_limit_is_refused_before_the_body_is_read():
    replicas, app = ingress()
    headers = [(b"content-length", str(LIMIT + 1).encode())]
    status, pulled = asyncio.run(call_asgi(app, headers, iter([b"x" * 100])))
    assert status == 413 and replicas.calls == []
    assert pulled == 1  # only drained (so the client reads the 413), nothing buffered


def test_a_streamed_body_is_cut_at_the_limit_and_never_forwarded():
    replicas, app = ingress()
    chunk = b"x" * (64 * 1024)

    def endless():
        while True:
            yield chunk

    status, pulled = asyncio.run(call_asgi(app, [], endless()))
    assert status == 413 and replicas.calls == []
    # buffered up to the limit, then at most the middleware's drain cap read and dropped
    assert pulled <= 2 + (64 * 2**20) // len(chunk) + 1


def test_a_body_at_the_limit_is_forwarded_whole_and_the_key_is_checked_first():
    replicas, app = ingress()
    body = b"x" * LIMIT
    response = post(app, "/v1/completions", content=body,
                    headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert response.status_code == 200 and replicas.calls[0].body == body
    # no key and a body over the limit: 401, the body never read
    assert post(app, "/v1/completions", content=body + b"x").status_code == 401


# ---------------------------------------------------------------------------- routing text
def text_of(prompt) -> str:
    return routing_prompt("/v1/completions", _json({"prompt": prompt}))


def test_token_id_prompts_route_as_one_character_per_token():
    assert text_of([1, 2, 3]) == "".join(chr(TOKEN_CHAR_BASE + i) for i in (1, 2, 3))
    assert text_of([[1, 2], [3]]) == text_of([1, 2, 3])
    assert text_of([1, 23]) != text_of([12, 3])  # a token is a character, never digits
    assert text_of([5, 6, 7, 8])[:2] == text_of([5, 6, 99])[:2]
    assert len(text_of([-1, 10**30])) == 2  # any int gives a valid character


def test_every_request_gets_a_non_empty_bounded_routing_text():
    assert text_of(["a", "b"]) == "ab"
    assert text_of("") == text_of([]) == text_of(None) == "/v1/completions"
    assert text_of("x" * (3 * MAX_ROUTING_CHARS)) == "x" * MAX_ROUTING_CHARS
    assert len(text_of([7] * (3 * MAX_ROUTING_CHARS))) == MAX_ROUTING_CHARS
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None}]  # fmt: skip
    assert routing_prompt("/v1/chat/completions", _json({"messages": chat})) == "Be brief.Hi"
    assert routing_prompt("/v1/chat/completions", b"{not json") == "/v1/chat/completions"
    nested = b"[" * 100_000 + b"]" * 100_000
    assert routing_prompt("/v1/completions", b'{"prompt": ' + nested + b"}") == "/v1/completions"
    assert routing_prompt("/v1/models", b"") == "/v1/models"


def test_rays_router_reads_a_token_id_prompt_as_non_empty_text():
    """The call the ingress builds for a token-id prompt, through Ray's router text extraction
    and the prefix match whose length it divides by (a ZeroDivisionError with empty text)."""
    replicas, app = ingress(api_key=None)
    post(app, "/v1/completions", json={"prompt": [[11, 12, 13], [14]], "max_tokens": 1})
    router = object.__new__(BoundedPrefixRouter)  # text extraction needs no router state
    pending = SimpleNamespace(args=[replicas.calls[0]], kwargs={})
    text = router._extract_text_from_request(pending)
    tree = BoundedPrefixTree(max_chars=100)
    tree.add_tenants(["r0", "r1"], 0.0)
    tree.insert(text[:2], "r1", 1.0)
    matched, tenants = tree.prefix_match(text, ["r0", "r1"])
    assert len(matched) / len(text) == 0.5 and tenants == ["r1"]


# ---------------------------------------------------------------------------- prefix tree
def test_the_tree_stays_bounded_and_evicts_the_least_recently_routed():
    tree = BoundedPrefixTree(max_chars=100)  # cut back to 90 chars when over 100
    tree.add_tenants(["r0", "r1"], 0.0)
    texts = [chr(ord("A") + i) * 20 for i in range(20)]  # 20 chars each, no common prefix
    for t, text in enumerate(texts, start=1):
        tree.insert(text, "r0", float(t))
        tree.insert("shared-" + text[:2], "r1", float(t))
        tree.check_invariants()
        assert tree.tenant_to_char_count["r0"] <= 100
    # r0 holds its 4 newest texts (80 chars): the 5th newest went when the 20th came
    assert tree.tenant_to_char_count["r0"] == 80
    for old in texts[:16]:
        assert tree.prefix_match(old, ["r0"])[0] == "", old
    for new in texts[16:]:
        assert tree.prefix_match(new, ["r0"]) == (new, ["r0"])


def test_a_touched_text_survives_eviction_and_an_oversized_one_leaves_nothing():
    tree = BoundedPrefixTree(max_chars=50)
    tree.add_tenants(["r0"], 0.0)
    tree.insert("A" * 20, "r0", 1.0)
    tree.insert("B" * 20, "r0", 2.0)
    tree.insert("A" * 20, "r0", 3.0)  # routed again: now the most recent
    tree.insert("C" * 20, "r0", 4.0)  # 60 > 50: evicts B, the least recently routed
    tree.check_invariants()
    assert tree.prefix_match("A" * 20, ["r0"])[0] == "A" * 20
    assert tree.prefix_match("B" * 20, ["r0"])[0] == ""
    tree.insert("D" * 80, "r0", 5.0)
    tree.check_invariants()
    assert tree.tenant_to_char_count["r0"] == 0


def test_random_routing_keeps_every_invariant_and_the_node_bound():
    rng = random.Random(0)
    tree = BoundedPrefixTree(max_chars=300)
    tenants = ["r0", "r1", "r2"]
    tree.add_tenants(tenants, 0.0)
    for t in range(1, 2000):
        suffix = "".join(rng.choices("abc", k=rng.randint(1, 40)))
        text = rng.choice(["sys-a:", "sys-b:", ""]) + suffix
        tree.insert(text, rng.choice(tenants), float(t))
        if t % 50 == 0:
            tree.remove_tenants([tenants[t % 3]])
            tree.add_tenants([tenants[t % 3]], float(t))
        tree.check_invariants()
    nodes, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        nodes += 1
        stack.extend(node.edge_label_to_child.values())
    assert nodes - 1 <= sum(tree.tenant_to_char_count.values()) <= 3 * 300


# ---------------------------------------------------------------------------- build_app args
def test_server_arguments_reuse_the_servers_flags(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    config = server_config_from_args({"num_replicas": "2", "max_request_body_bytes": "1MiB"})
    assert config.api_key is None and config.max_request_body_bytes == 2**20
    assert server_config_from_args({"api_key": "k"}).api_key == "k"
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert server_config_from_args({}).api_key == "from-env"
    with pytest.raises(ValueError, match="--api-key"):
        server_config_from_args({"api_key": ""})
    with pytest.raises(ValueError, match="unknown build_app arguments.*'api-key'"):
        server_config_from_args({"api-key": "k"})  # misspelt: must not serve without a key


# ---------------------------------------------------------------------------- replica
def test_a_replica_answers_without_the_key_and_writes_its_prefix_store_at_shutdown(
    tiny_model_dir, tmp_path
):
    directory, _ = tiny_model_dir("llama3")
    store = tmp_path / "store"
    argv = [str(directory), "--dtype", "float32", "--kv-cache-memory", "4MiB",
            "--max-model-len", "256", "--prefix-cache-dir", str(store)]  # fmt: skip
    replica = KVServeReplica(argv, ServerConfig(api_key=KEY), replica_name="r0")
    try:
        body = _json({"prompt": list(range(100, 140)), "max_tokens": 2})
        call = ForwardCall("POST", "/v1/completions", body, "x")
        reply = asyncio.run(replica.forward(call))
        assert reply.status_code == 200 and reply.replica == "r0", reply.body
        replica.check_health()
    finally:
        replica.__del__()  # what Ray Serve calls when it stops the replica
    assert list(store.glob("*/group-*.safetensors")), sorted(store.rglob("*"))
    with pytest.raises(RuntimeError, match="not running"):
        replica.check_health()
    replica.__del__()  # idempotent: Python calls it again when the object goes
