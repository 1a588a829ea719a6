"""`kvserve serve`: the FastAPI app (OpenAI-compatible routes, /health, /metrics, /tokenize,
/detokenize, vLLM's POST /reset_prefix_cache) and `run_server`, which loads the engine, then
serves until SIGTERM or Ctrl+C.

Shutdown: uvicorn stops accepting, lets in-flight requests finish for --shutdown-timeout
seconds (then cancels them, which aborts them in the engine), runs the lifespan exit (the
engine thread stops), and run_server returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.config import EngineConfig, RequestLimits
from kvserve.engine.async_llm import AsyncLLM
from kvserve.errors import ParameterError
from kvserve.flags import non_default_flags
from kvserve.server import prefix_pins
from kvserve.server.args import ServerConfig
from kvserve.server.errors import APIError, error_response, install_error_handlers, parse_body
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PinRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnpinRequest,
)
from kvserve.server.serving import ServingContext
from kvserve.server.serving_chat import ChatHandler, chat_token_ids
from kvserve.server.serving_completions import CompletionsHandler
from kvserve.server.stats_logger import StatsLogger
from kvserve.server.tokenization import ServerTokenizers
from kvserve.server.tools import check_tools

GIL_SWITCH_INTERVAL_S = 0.0002  # see run_server; KVSERVE_GIL_SWITCH_INTERVAL overrides (A/B)

logger = logging.getLogger("kvserve")


def build_app(ctx: ServingContext, config: ServerConfig) -> FastAPI:
    """The ASGI app around a started AsyncLLM; the lifespan exit stops the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats = StatsLogger(ctx.metrics, lambda: ctx.async_llm.stats, config.log_stats_interval)
        task = asyncio.create_task(stats.run()) if config.log_stats_interval > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            ctx.async_llm.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    install_error_handlers(app)
    _add_routes(app, ctx)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:  # added last = outermost: unauthenticated bodies are never buffered
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    completions, chat = CompletionsHandler(ctx), ChatHandler(ctx)

    @app.get("/health")
    async def health() -> Response:
        if ctx.async_llm.is_running:
            return Response(status_code=200)
        return error_response("the engine is not running", 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(
            id=ctx.model_name,
            root=ctx.async_llm.engine.model_name,
            max_model_len=ctx.max_model_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        return await completions.create(await parse_body(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        return await chat.create(await parse_body(raw, ChatCompletionRequest), raw)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(include_pinned: bool = False) -> JSONResponse:
        """Drop every cached block no request holds, on the engine thread (behind the API key
        like every route but /health and /metrics); pinned prefixes stay unless
        ?include_pinned=true."""
        num_dropped = await ctx.async_llm.call(
            lambda engine: engine.reset_prefix_cache(include_pinned)
        )
        return JSONResponse({"num_blocks_dropped": num_dropped})

    @app.post("/v1/prefix_cache/pin")
    async def pin(raw: Request) -> JSONResponse:
        info = await prefix_pins.pin_prefix(ctx, await parse_body(raw, PinRequest))
        return JSONResponse(info.model_dump())

    @app.post("/v1/prefix_cache/unpin")
    async def unpin(raw: Request) -> JSONResponse:
        info = await prefix_pins.unpin_prefix(ctx, await parse_body(raw, UnpinRequest))
        return JSONResponse(info.model_dump())

    @app.get("/v1/prefix_cache/pins")
    async def pins() -> JSONResponse:
        return JSONResponse((await prefix_pins.list_pins(ctx)).model_dump())

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, TokenizeRequest)
        return JSONResponse((await _tokenize(ctx, body)).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, DetokenizeRequest)
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        text = await ctx.tokenizers.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


async def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: a text prompt, or chat messages through the template."""
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt or messages", "prompt")
    tokenizers = ctx.tokenizers
    if body.messages is not None:
        tools = check_tools(body.tools, None, None).tools
        token_ids = await chat_token_ids(ctx, body.messages, tools)
    else:
        ctx.check_text(len(body.prompt), "prompt")
        token_ids = await tokenizers.encode(body.prompt, body.add_special_tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = await tokenizers.convert_ids_to_tokens(token_ids)
    return TokenizeResponse(
        count=len(token_ids),
        max_model_len=ctx.max_model_len,
        tokens=token_ids,
        token_strs=token_strs,
    )


# ---------------------------------------------------------------------- process entry point
def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Bind, load the engine, serve until SIGTERM/SIGINT; 0 after a clean shutdown.

    ValueError (bad flag, port in use, KV cache too small) reaches the CLI as a one-line
    error.  The port is taken before the model loads, so a busy port fails in a second;
    connections made while loading wait in the listen backlog."""
    import uvicorn

    from kvserve.engine.llm_engine import LLMEngine

    logger.info("kvserve serve: non-default args: %s", _non_default_args(engine_config, config))
    # The engine thread gives up the GIL inside every torch op and needs it back between
    # them; while the event loop runs Python (streaming a step's outputs), the default 5 ms
    # switch interval can hold it off that long each time.  0.2 ms bounds the
    # wait: served W1 measured +10% and +14% output tok/s (docs/decisions/gil-switch-interval.md).
    interval = os.environ.get("KVSERVE_GIL_SWITCH_INTERVAL", GIL_SWITCH_INTERVAL_S)
    sys.setswitchinterval(float(interval))
    sock = _bind(config.host, config.port)
    # Built on the engine thread (see AsyncLLM.launch): one thread runs every torch op.
    async_llm = AsyncLLM.launch(
        lambda: LLMEngine(engine_config), engine_config.limits.max_waiting_requests
    )
    # Copies made before the engine thread steps.
    tokenizers = ServerTokenizers(async_llm.engine.tokenizer)
    try:
        ctx = serving_context(async_llm, config, engine_config.limits, tokenizers)
        uv_config = uvicorn.Config(
            build_app(ctx, config),
            log_config=None,  # our logging set-up (kvserve.cli) formats uvicorn's lines too
            access_log=not config.disable_uvicorn_access_log,
            timeout_graceful_shutdown=config.shutdown_timeout,
        )
        server = uvicorn.Server(uv_config)
        async_llm.on_fatal = lambda _: _exit_soon(server)
        async_llm.start(config.engine_stall_timeout)
        _log_ready(ctx, config, sock)
        with _signals_end_in_return():
            server.run(sockets=[sock])
    finally:
        async_llm.shutdown()
        tokenizers.shutdown()
        sock.close()
    if async_llm.error is not None:
        logger.critical(
            "kvserve serve: the engine stopped (%s: %s); exiting with status 1 so that a "
            "supervisor restarts the server", type(async_llm.error).__name__, async_llm.error,
        )  # fmt: skip
        return 1
    logger.info("kvserve serve: stopped")
    return 0


def _exit_soon(server: Any) -> None:
    """Called on the engine thread when it stopped for good: stop serving now, without the
    graceful wait (every open request has already been failed)."""
    server.should_exit = True
    server.force_exit = True


def serving_context(
    async_llm: AsyncLLM,
    config: ServerConfig,
    limits: RequestLimits,
    tokenizers: ServerTokenizers,
) -> ServingContext:
    engine = async_llm.engine
    name = config.served_model_name or engine.model_name
    spec = engine.sizing.spec
    cache_info = {
        "block_size": str(spec.block_size),
        "num_blocks": str(engine.sizing.num_blocks),
        "kv_cache_dtype": spec.dtype,
        "max_model_len": str(engine.max_model_len),
    }
    host_bytes = engine.sizing.host_spec.bytes_per_block  # the host and disk tiers' format
    tier_bytes = {"device": spec.bytes_per_block, "host": host_bytes, "disk": host_bytes}
    metrics = ServerMetrics(lambda: async_llm.stats, name, cache_info, tier_bytes)
    return ServingContext(
        async_llm,
        name,
        metrics,
        limits,
        tokenizers,
        config.stream_stall_timeout,
        tool_call_parser=config.tool_call_parser,
    )


SEND_BUFFER_BYTES = 256 * 1024  # ~5 MB/s per connection at a 50 ms round trip


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by every accepted connection: a client that stops reading then blocks
        # the server's sends after ~0.5 MiB (the kernel doubles it) instead of the several
        # MiB autotuning reaches on loopback, so --stream-stall-timeout starts within seconds.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        sock.bind(address)
        sock.listen(2048)  # claim the port now: a second server fails here, not after loading
    except OSError as exc:
        raise ParameterError(
            "--port", f"cannot listen on {host}:{port} ({exc}); pick another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock


@contextmanager
def _signals_end_in_return() -> Iterator[None]:
    """uvicorn handles SIGTERM/SIGINT gracefully, then re-raises the signal to the handler it
    found; a no-op handler here turns that re-raise into a normal return (exit code 0)."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _non_default_args(engine_config: EngineConfig, config: ServerConfig) -> dict[str, Any]:
    given = non_default_flags([engine_config, config])
    if given.get("api_key"):
        given["api_key"] = "<hidden>"
    return given


def _log_ready(ctx: ServingContext, config: ServerConfig, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    sizing = ctx.async_llm.engine.sizing
    logger.info(
        "serving %r: max_model_len %d, up to %.1f sequences of that length in the KV cache, "
        "API key %s",
        ctx.model_name,
        ctx.max_model_len,
        sizing.max_concurrency,
        "required" if config.api_key else "not required",
    )
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    logger.info("OpenAI-compatible API at %s/v1 (also /health, /metrics, /tokenize)", url)
