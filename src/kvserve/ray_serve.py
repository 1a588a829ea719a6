"""Data-parallel kvserve on Ray Serve: N engine replicas (each its own KV cache and prefix
cache) behind Ray Serve's prefix-aware request router, so that requests sharing a prefix land
on the replica that already holds its blocks.

    ray start --head                       # or an existing cluster (RAY_ADDRESS)
    serve start --http-port 8000           # optional: the HTTP port of Serve's proxy
    serve run kvserve.ray_serve:build_app num_replicas=2 \\
        engine_args="--dtype float32 --kv-cache-memory 1GiB"

    HTTP -> KVServeIngress (FastAPI, parses the prompt / messages)
         -> DeploymentHandle -> PrefixCacheAffinityRouter (ray.serve.llm.request_router):
            picks the replica whose routed texts share the longest prefix with this one (the
            least loaded when none shares 10%)
         -> KVServeReplica.forward: the request through kvserve's own FastAPI app in-process
            (same validation, errors and usage as `kvserve serve`)

`engine_args` are `kvserve serve`'s engine flags, as one string.  A streamed request is
answered with its whole event stream at once (the replica's ASGI call collects it): the
client reads the same events, not incrementally.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.flags import add_engine_args, engine_config_from_args
from kvserve.server.api_server import build_app as build_kvserve_app
from kvserve.server.api_server import serving_context
from kvserve.server.args import ServerConfig
from kvserve.server.tokenization import ServerTokenizers

REPLICA_HEADER = "x-kvserve-replica"  # which replica answered (tests and debugging)


@dataclass(frozen=True)
class CompletionCall:
    """A /v1/completions body; `prompt` is what the prefix-aware router matches on."""

    body: bytes
    prompt: Any
    path: str = "/v1/completions"


@dataclass(frozen=True)
class ChatCall:
    """A /v1/chat/completions body; the router matches on the messages' contents."""

    body: bytes
    messages: Any
    path: str = "/v1/chat/completions"


@dataclass(frozen=True)
class PlainCall:
    """Any other route; the router matches on its path (it divides by the text's length, so
    the text must not be empty)."""

    path: str
    method: str = "GET"
    body: bytes = b""

    @property
    def prompt(self) -> str:
        return self.path


@dataclass(frozen=True)
class Reply:
    status_code: int
    content_type: str
    body: bytes
    replica: str


def engine_config_from_argv(argv: list[str]) -> EngineConfig:
    """`kvserve serve`'s engine flags (a list of words) -> EngineConfig."""
    parser = argparse.ArgumentParser(prog="kvserve.ray_serve engine_args", add_help=False)
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))


class KVServeReplica:
    """One kvserve engine; its FastAPI app answers every forwarded request."""

    def __init__(self, engine_argv: list[str], served_model_name: str | None = None) -> None:
        from ray import serve

        config = engine_config_from_argv(engine_argv)
        self.async_llm = AsyncLLM.launch(
            lambda: LLMEngine(config), config.limits.max_waiting_requests
        )  # built on its engine thread, as in kvserve serve (see AsyncLLM.launch)
        engine = self.async_llm.engine
        server_config = ServerConfig(served_model_name=served_model_name, log_stats_interval=0)
        ctx = serving_context(self.async_llm, server_config, config.limits,
                              ServerTokenizers(engine.tokenizer))  # fmt: skip
        self.async_llm.start()
        self.app = build_kvserve_app(ctx, server_config)
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def forward(self, call: CompletionCall | ChatCall | PlainCall) -> Reply:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            method = getattr(call, "method", "POST")
            headers = {"content-type": "application/json"}
            response = await client.request(method, call.path, content=call.body, headers=headers,
                                            timeout=None)  # fmt: skip
        content_type = response.headers.get("content-type", "application/json")
        return Reply(response.status_code, content_type, response.content, self.replica)

    def check_health(self) -> None:
        """Ray Serve calls it periodically: a dead engine gets its replica replaced."""
        if not self.async_llm.is_running:
            raise RuntimeError(f"the engine is not running: {self.async_llm.error}")


class KVServeIngress:
    """The HTTP entry: reads the prompt for the router, forwards, copies the reply back."""

    def __init__(self, replicas: Any) -> None:  # a DeploymentHandle of KVServeReplica
        self.replicas = replicas

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        call: CompletionCall | ChatCall | PlainCall
        if path == "/v1/completions":
            call = CompletionCall(body, _field(body, "prompt"))
        elif path == "/v1/chat/completions":
            call = ChatCall(body, _field(body, "messages"))
        else:
            call = PlainCall(path, request.method, body)
        reply: Reply = await self.replicas.forward.remote(call)
        return Response(reply.body, reply.status_code, media_type=reply.content_type,
                        headers={REPLICA_HEADER: reply.replica})  # fmt: skip


def _field(body: bytes, name: str) -> Any:
    """The JSON body's field, or "?" (never empty: see PlainCall; the replica answers a bad
    body with its own 400)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return "?"
    value = parsed.get(name) if isinstance(parsed, dict) else None
    return value or "?"


def prefix_aware_router() -> type:
    """Ray Serve's PrefixCacheAffinityRouter.  Its public module (ray.serve.llm) imports the
    whole of Ray's LLM stack (pyarrow, cloud filesystems, ...): without `ray[llm]` installed,
    take the same class from the module that defines it."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return PrefixCacheAffinityRouter


def build_app(args: dict[str, str]):  # noqa: ANN201 - a ray.serve Application
    """`serve run kvserve.ray_serve:build_app num_replicas=N engine_args="..."` (also
    served_model_name=NAME, replica_num_cpus=C: CPUs Ray reserves per replica, default 1)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    num_replicas = int(args.get("num_replicas", 2))
    engine_argv = shlex.split(args.get("engine_args", ""))
    replica = serve.deployment(
        KVServeReplica,
        name="kvserve",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": float(args.get("replica_num_cpus", 1))},
        request_router_config=RequestRouterConfig(request_router_class=prefix_aware_router()),
    )
    ingress = serve.deployment(KVServeIngress, name="ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(engine_argv, args.get("served_model_name")))
