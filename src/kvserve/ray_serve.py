"""Data-parallel kvserve on Ray Serve: N engine replicas (each its own KV cache and prefix
cache) behind a prefix-aware request router, so that requests sharing a prefix land on the
replica that already holds its blocks.

    ray start --head                       # or an existing cluster (RAY_ADDRESS)
    serve start --http-port 8000           # optional: the HTTP port of Serve's proxy
    KVSERVE_API_KEY=... serve run kvserve.ray_serve:build_app num_replicas=2 \\
        engine_args="--dtype float32 --kv-cache-memory 1GiB"

    HTTP -> KVServeIngress (build_ingress_app: `kvserve serve`'s ApiKeyMiddleware, then its
            BodyLimitMiddleware, then the routing text of the prompt / messages)
         -> DeploymentHandle -> BoundedPrefixRouter (Ray Serve's PrefixCacheAffinityRouter
            on a bounded prefix tree): the replica whose routed texts share the longest
            prefix with this one (the one holding the least text when none shares 10%)
         -> KVServeReplica.forward: the request through kvserve's own FastAPI app in-process
            (same validation, errors and usage as `kvserve serve`)

The app keeps `kvserve serve`'s guarantees: the API key (api_key=KEY or KVSERVE_API_KEY,
checked at the ingress, /health and /metrics open), the body limit (max_request_body_bytes=,
default 16MiB: a Content-Length over it is refused unread, a chunked body is buffered only up
to it), and at replica shutdown the engine is closed, which writes the --prefix-cache-dir store.
`engine_args` are `kvserve serve`'s engine flags, as one string.  A streamed request is
answered with its whole event stream at once (the replica's ASGI call collects it): the
client reads the same events, not incrementally.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import ray
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.flags import (
    add_engine_args,
    add_fields,
    engine_config_from_args,
    flag_name,
    from_args,
)
from kvserve.server.api_server import build_app as build_kvserve_app
from kvserve.server.api_server import serving_context
from kvserve.server.args import ServerConfig
from kvserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from kvserve.server.tokenization import ServerTokenizers

try:  # ray.serve.llm imports all of Ray's LLM stack (pyarrow, ...): without `ray[llm]`, take
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter  # the defining module
except ImportError:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

REPLICA_HEADER = "x-kvserve-replica"  # which replica answered (tests and debugging)
# The router matches on the first MAX_ROUTING_CHARS characters of a prompt (one per token of a
# token-id prompt): prompts sharing that much go to the same replicas, and neither the tree
# nor the router's per-request work grows with the prompt.
MAX_ROUTING_CHARS = 8192
MAX_TREE_CHARS_PER_REPLICA = 1_000_000  # the tree's bound: see BoundedPrefixTree
TOKEN_CHAR_BASE = 0x10000  # token id i -> chr(0x10000 + i): above the surrogates, exact < 2**20
NUM_TOKEN_CHARS = 0x110000 - TOKEN_CHAR_BASE
BUILD_APP_ARGS = ("num_replicas", "engine_args", "replica_num_cpus")
SERVER_ARGS = ("api_key", "max_request_body_bytes", "served_model_name")  # ServerConfig fields
REPLICA_SHUTDOWN_TIMEOUT_S = 60.0  # Serve's wait for in-flight requests + the store write
HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass(frozen=True)
class ForwardCall:
    """One HTTP request for a replica.  `prompt` is what the prefix-aware router matches on
    (Ray's router reads an argument's `prompt`): never empty, since the router divides by its
    length, and at most MAX_ROUTING_CHARS characters."""

    method: str
    path: str
    body: bytes
    prompt: str
    content_type: str = "application/json"


@dataclass(frozen=True)
class Reply:
    status_code: int
    content_type: str
    body: bytes
    replica: str


Forward = Callable[[ForwardCall], Awaitable[Reply]]


def routing_prompt(path: str, body: bytes) -> str:
    """The routing text of a request: a completion's prompt (text, a list of texts, token ids
    or lists of token ids), a chat's message contents, else the path (a bad body too: the
    replica answers it with its own 400)."""
    field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}.get(path)
    if field is None:
        return path
    try:
        parsed = json.loads(body)
        value = parsed.get(field) if isinstance(parsed, dict) else None
        return _routing_text(value) or path
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python recurses
        return path


def _routing_text(value: Any) -> str:
    pieces: list[str] = []
    num_chars = 0
    for piece in _text_pieces(value):
        pieces.append(piece)
        num_chars += len(piece)
        if num_chars >= MAX_ROUTING_CHARS:
            break
    return "".join(pieces)[:MAX_ROUTING_CHARS]


def _text_pieces(value: Any) -> Iterator[str]:
    """Text in prompt order; a token id is one character, so equal id prefixes are equal text
    prefixes and the tree's character bound is a token bound."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, int):
        yield chr(TOKEN_CHAR_BASE + value % NUM_TOKEN_CHARS)
    elif isinstance(value, list):
        for item in value:
            yield from _text_pieces(item)
    elif isinstance(value, dict):  # a chat message, or a content part ({"type": "text", ...})
        yield from _text_pieces(value.get("content", value.get("text")))


def build_ingress_app(forward: Forward, config: ServerConfig) -> Starlette:
    """The HTTP entry as an ASGI app: `kvserve serve`'s API-key check (outermost, so that
    unauthenticated bodies are never read) and body limit around a handler that forwards every
    route to `forward`.  A Starlette app, so that Serve can add its exception handlers (503 on
    back-pressure).  Needs no Ray: Serve calls it through KVServeIngress, tests directly."""
    middleware = [Middleware(ApiKeyMiddleware, api_key=config.api_key)] if config.api_key else []
    middleware.append(Middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes))
    route = Route("/{path:path}", _handler(forward), methods=HTTP_METHODS)
    return Starlette(routes=[route], middleware=middleware)


def _handler(forward: Forward) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        body = await request.body()  # within the limit: BodyLimitMiddleware buffered it
        path = request.url.path
        content_type = request.headers.get("content-type", "application/json")
        call = ForwardCall(request.method, path, body, routing_prompt(path, body), content_type)
        reply = await forward(call)
        return Response(reply.body, reply.status_code, media_type=reply.content_type,
                        headers={REPLICA_HEADER: reply.replica})  # fmt: skip

    return handle


class KVServeIngress:
    """The ingress deployment (wrapped by `serve.ingress()` in build_app): Serve calls
    `__serve_build_asgi_app__` once the handle is set and serves HTTP with its app."""

    def __init__(self, replicas: Any, config: ServerConfig) -> None:  # a DeploymentHandle
        self.replicas = replicas
        self.config = config

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_ingress_app(self.replicas.forward.remote, self.config)


class KVServeReplica:
    """One kvserve engine; its FastAPI app answers every forwarded request (without the API
    key: the ingress checked it, and replicas are reachable only through Serve's handles)."""

    def __init__(
        self, engine_argv: list[str], config: ServerConfig, replica_name: str | None = None
    ) -> None:
        engine_config = engine_config_from_argv(engine_argv)
        self.async_llm = AsyncLLM.launch(
            lambda: LLMEngine(engine_config), engine_config.limits.max_waiting_requests
        )  # built on its engine thread, as in kvserve serve (see AsyncLLM.launch)
        self.tokenizers = ServerTokenizers(self.async_llm.engine.tokenizer)
        config = replace(config, api_key=None, log_stats_interval=0)
        ctx = serving_context(self.async_llm, config, engine_config.limits, self.tokenizers)
        self.async_llm.start()
        self.app = build_kvserve_app(ctx, config)
        self.replica = replica_name or serve_replica_id()

    async def forward(self, call: ForwardCall) -> Reply:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            response = await client.request(call.method, call.path, content=call.body,
                                            headers={"content-type": call.content_type},
                                            timeout=None)  # fmt: skip
        content_type = response.headers.get("content-type", "application/json")
        return Reply(response.status_code, content_type, response.content, self.replica)

    def check_health(self) -> None:
        """Ray Serve calls it periodically: a dead engine gets its replica replaced."""
        if not self.async_llm.is_running:
            raise RuntimeError(f"the engine is not running: {self.async_llm.error}")

    def __del__(self) -> None:
        """Serve's shutdown hook (scale-down, redeploy, `serve shutdown`), called once the
        replica's requests are done: stop the engine thread, which closes the engine and so
        writes the blocks not yet in the --prefix-cache-dir store (AsyncLLM._close_engine).
        The ASGI transport runs no lifespan, so nothing else would.  Idempotent."""
        if hasattr(self, "async_llm"):  # not when __init__ failed
            self.async_llm.shutdown()
            self.tokenizers.shutdown()


def serve_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class BoundedPrefixTree(PrefixTree):
    """Ray's prefix tree with a hard bound: after every insert each replica (tenant) holds at
    most `max_chars` characters, cut back to 90% of it by evicting its least recently routed
    texts (Ray's own LRU, PrefixTree.evict_tenant_by_lru).  A node no replica holds is
    removed, and each node holds at least one character, so the tree has at most
    num_replicas * max_chars characters and as many nodes (plus the root).  A single text
    longer than the bound is evicted at once (the ingress routes on MAX_ROUTING_CHARS)."""

    def __init__(self, max_chars: int = MAX_TREE_CHARS_PER_REPLICA) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        super().__init__()
        self.max_chars = max_chars
        self.target_chars = max_chars * 9 // 10

    def insert(self, text: str, tenant: str, time_s: float) -> None:
        with self.lock:
            super().insert(text, tenant, time_s)
            num_chars = self.tenant_to_char_count.get(tenant, 0)
            if num_chars > self.max_chars:
                self.evict_tenant_by_lru(tenant, num_chars - self.target_chars)

    def check_invariants(self) -> None:
        """Every reachable node is non-empty and held; the counts add up and keep the bound."""
        with self.lock:
            counts = dict.fromkeys(self.tenant_to_char_count, 0)
            nodes = list(self.root.edge_label_to_child.values())
            while nodes:
                node = nodes.pop()
                assert node.text and node.tenant_to_last_access_time, node.text
                for tenant in node.tenant_to_last_access_time:
                    counts[tenant] += len(node.text)
                nodes.extend(node.edge_label_to_child.values())
            assert counts == self.tenant_to_char_count, (counts, self.tenant_to_char_count)
            assert max(counts.values(), default=0) <= self.max_chars, counts


class BoundedPrefixRouter(PrefixCacheAffinityRouter):
    """PrefixCacheAffinityRouter on a BoundedPrefixTree actor (Ray's own tree never evicts
    unless its interval loop is on, and is not bounded between two runs of it)."""

    def initialize_state(self, max_tree_chars: int = MAX_TREE_CHARS_PER_REPLICA,
                         **kwargs: Any) -> None:  # fmt: skip
        super().initialize_state(tree_actor=self._tree(max_tree_chars), **kwargs)

    def _tree(self, max_chars: int) -> Any:
        """One tree per deployment, shared by the routers of every handle: a detached named
        actor that `serve shutdown` kills, as Ray's router makes its own."""
        deployment = self._deployment_id
        parts = (SERVE_NAMESPACE, deployment.app_name, deployment.name)
        namespace = "::".join(part for part in parts if part)
        options = _TREE_ACTOR.options(
            name="KVServePrefixTree", namespace=namespace, get_if_exists=True, lifetime="detached"
        )
        tree = options.remote(max_chars)
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller._register_shutdown_cleanup_actor.remote(tree))
        return tree


_TREE_ACTOR = ray.remote(BoundedPrefixTree)


def engine_config_from_argv(argv: list[str]) -> EngineConfig:
    """`kvserve serve`'s engine flags (a list of words) -> EngineConfig."""
    parser = argparse.ArgumentParser(prog="kvserve.ray_serve engine_args", add_help=False)
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))


def server_config_from_args(args: dict[str, str]) -> ServerConfig:
    """build_app's api_key=, max_request_body_bytes=, served_model_name= through `kvserve
    serve`'s own flags: the same KVSERVE_API_KEY default, size parsing and checks.
    ValueError for a key build_app does not know (a misspelt api_key must not serve openly)."""
    unknown = sorted(set(args) - set(BUILD_APP_ARGS) - set(SERVER_ARGS))
    if unknown:
        raise ValueError(f"unknown build_app arguments {unknown}; known: "
                         f"{', '.join(BUILD_APP_ARGS + SERVER_ARGS)}")  # fmt: skip
    parser = argparse.ArgumentParser(prog="kvserve.ray_serve", add_help=False)
    add_fields(parser, ServerConfig, only=SERVER_ARGS)
    argv = [word for name in SERVER_ARGS if name in args for word in (flag_name(name), args[name])]
    return from_args(ServerConfig, parser.parse_args(argv))


def build_app(args: dict[str, str]):  # noqa: ANN201 - a ray.serve Application
    """`serve run kvserve.ray_serve:build_app num_replicas=N engine_args="..."` (also
    api_key=KEY, max_request_body_bytes=SIZE, served_model_name=NAME, replica_num_cpus=C:
    CPUs Ray reserves per replica, default 1)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    config = server_config_from_args(args)
    replica = serve.deployment(
        KVServeReplica,
        name="kvserve",
        num_replicas=int(args.get("num_replicas", 2)),
        ray_actor_options={"num_cpus": float(args.get("replica_num_cpus", 1))},
        request_router_config=RequestRouterConfig(request_router_class=BoundedPrefixRouter),
        graceful_shutdown_timeout_s=REPLICA_SHUTDOWN_TIMEOUT_S,
    )
    ingress = serve.deployment(
        serve.ingress()(KVServeIngress), name="ingress", ray_actor_options={"num_cpus": 0}
    )
    engine_argv = shlex.split(args.get("engine_args", ""))
    return ingress.bind(replica.bind(engine_argv, replace(config, api_key=None)), config)
