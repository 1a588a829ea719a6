"""The HTTP server's configuration; `kvserve serve` builds its flags from these fields (the
engine's come from EngineConfig), so each default is written once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import ParameterError
from kvserve.server.tool_parsers import PARSERS


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs.  ValueError names the flag."""

    host: str = field(default="127.0.0.1", metadata=_help("Address to listen on."))
    port: int = field(default=8000, metadata=_help("Port to listen on."))
    api_key: str | None = field(
        default=None,
        metadata=_help(
            "Require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
            "(or set KVSERVE_API_KEY).",
            env="KVSERVE_API_KEY",
        ),
    )
    served_model_name: str | None = field(
        default=None, metadata=_help("Model name in the API (default: the file's).")
    )
    max_request_body_bytes: int = field(
        default=16 * 2**20,
        metadata=_help("Larger request bodies get HTTP 413, e.g. 16MiB.", parse="size"),
    )
    log_stats_interval: float = field(
        default=5.0,
        metadata=_help(
            "Seconds between status lines (throughput, queue, KV usage) while busy; 0: off."
        ),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=_help(
            "On SIGTERM, seconds in-flight requests may take to finish before they are aborted."
        ),
    )
    stream_stall_timeout: float = field(
        default=60.0,
        metadata=_help(
            "Abort a streaming request (freeing its blocks) when its client has read nothing "
            "for this many seconds while output waits; 0: never."
        ),
    )
    engine_stall_timeout: float = field(
        default=300.0,
        metadata=_help(
            "When one engine step or command runs this many seconds (a hung collective, a "
            "stuck store), /health answers 503, the reason is logged and the process exits "
            "with status 1 for its supervisor to restart it; 0: never. A step is bounded by "
            "--max-num-batched-tokens, so a long prompt is many short steps, not a stall."
        ),
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata=_help(
            "How tool calls are read from the model's output in /v1/chat/completions "
            '(vLLM\'s flag). hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call> '
            "blocks (Hermes, Qwen 2.5/3, and the tool prompt kvserve writes for chat templates "
            "that ignore tools).",
            choices=sorted(PARSERS),
        ),
    )
    disable_uvicorn_access_log: bool = field(
        default=False, metadata=_help("Do not log one line per HTTP request.")
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ParameterError("--port", f"must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes <= 0:
            raise ParameterError("--max-request-body-bytes", "must be positive, e.g. 16MiB")
        if self.log_stats_interval < 0:
            raise ParameterError("--log-stats-interval", "must be >= 0 seconds (0 turns it off)")
        if self.shutdown_timeout < 0:
            raise ParameterError("--shutdown-timeout", "must be >= 0 seconds")
        if self.stream_stall_timeout < 0:
            raise ParameterError("--stream-stall-timeout", "must be >= 0 seconds (0 turns it off)")
        if self.engine_stall_timeout < 0:
            raise ParameterError("--engine-stall-timeout", "must be >= 0 seconds (0 turns it off)")
        if self.tool_call_parser not in PARSERS:
            raise ParameterError(
                "--tool-call-parser", f"must be one of {', '.join(sorted(PARSERS))}"
            )
        if self.api_key == "":
            raise ParameterError("--api-key", "must not be empty (omit it to serve without a key)")
